"""apps/grpo `mode: async` (docs/async_rl.md): SIGKILLed at seeded random moments while the
generators are mid-sequence and resumed each time (from the second start on with 3 generator
replicas instead of 2: the in-flight requests are re-dealt), the job ends with metrics and
weights bitwise equal to an uninterrupted run, and every prompt is trained exactly once per
epoch. Each kill names the in-flight requests that the step it resumes from captured:
(replica, seq, sample, tokens decoded so far).

Real `python -m apps.grpo.main` processes with their own Ray, killed with SIGKILL (the harness
of tests/test_grpo_e2e.py, apps/grpo/chaos.py).
"""

from __future__ import annotations

import os
import random

import pytest
from test_grpo_e2e import check_every_prompt_once_per_epoch, check_resumed, read, run_to_end

from apps.grpo import chaos
from benchmarks.async_rl.workload import in_flight_saved
from forge_ckpt import committed_steps, serialization
from forge_ckpt.actors.weights import is_ref
from forge_ckpt.steps import layout

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "grpo_async_test.yaml")
SLOW = {"FORGE_CKPT_FAULT": "fsync:sleep=0.05"}
INTERVAL = 2  # checkpoint.interval of the config
# (overrides of this start, how it is killed): from the second start on, one replica more
STARTS = [([], "random"), (["policy.replicas=3"], "during_save")]


def check_weights_stored_once(folder: str, step: int, lag: int = 1) -> None:
    """The generators hold versions step-lag .. step: the trainer's (step) is a reference in
    every file, an older one is tensors in replica 0's file and a reference in the others'."""
    comp = layout.read_committed(folder, step).components["generators"]
    for j, rec in sorted(layout.replica_files(comp, "generators").items()):
        held = serialization.load(os.path.join(layout.step_dir(folder, step), rec.path))
        held = held["state"]["weights"]
        assert held[str(step)] == {"ref": "trainer", "version": step}
        for v in range(max(0, step - lag), step):
            assert is_ref(held[str(v)]) == (j > 0), (j, v, held[str(v)])


def kill_at_random_step(job: chaos.Job, run_dir: str, rng: random.Random) -> chaos.Kill | None:
    """Kill once a step drawn from `rng` has trained: 1 or 2 steps past the next save (so each
    kill resumes from a newer step); the generators are decoding the next steps then (the
    moment is a condition, not a sleep)."""
    newest = max(committed_steps(os.path.join(run_dir, chaos.CHECKPOINTS)), default=0)
    target = newest + INTERVAL + rng.randint(1, 2)
    if not chaos.wait_until(job, lambda: chaos.metrics_lines(run_dir) >= target, 600, 0.001):
        return None
    folder = os.path.join(run_dir, chaos.CHECKPOINTS)
    during = chaos.saving(folder)
    job.kill()
    return chaos.Kill(0, "random", chaos.metrics_lines(run_dir), committed_steps(folder), during)


@pytest.fixture
def reference(grpo_reference):
    return grpo_reference(CONFIG)


@pytest.mark.timeout(900)  # four job starts (reference, two kills, the end): ~2 min each when busy
def test_async_job_killed_mid_generation_resumes_bitwise(reference, tmp_path):
    rng = random.Random(25)
    run_dir = str(tmp_path / "run")
    folder = os.path.join(run_dir, chaos.CHECKPOINTS)
    previous, overrides, captured = None, [], []
    for n, (overrides, moment) in enumerate(STARTS):
        job = chaos.Job(CONFIG, run_dir, overrides, SLOW, str(tmp_path / f"start{n}.log"))
        if previous is not None:
            check_resumed(job, previous)
        if moment == "during_save":
            kill = chaos.kill_at(job, run_dir, moment)
        else:
            kill = kill_at_random_step(job, run_dir, rng)
        assert kill is not None, f"job ended before kill {n}"
        step = kill.committed_at_kill[-1] if kill.committed_at_kill else 0
        requests = in_flight_saved(folder, step) if step else []
        if step:
            check_weights_stored_once(folder, step)
        print(f"kill {n} ({moment}): resumes from step {step}; in flight there: {requests}")
        captured.append(requests)
        previous = kill
    job = run_to_end(run_dir, overrides, {}, str(tmp_path / "last.log"), CONFIG)
    check_resumed(job, previous)
    assert "GRPO async: resumed in-flight requests" in read(job.log).decode()
    assert layout.committed_steps(folder)[-1] == 12
    for name in (chaos.METRICS, chaos.WEIGHTS):
        assert read(os.path.join(run_dir, name)) == read(os.path.join(reference, name)), name
    check_every_prompt_once_per_epoch(os.path.join(run_dir, chaos.METRICS))
    # several kills found generations mid-sequence in the step they resume from
    partial = [r for r in captured if any(tokens > 0 for *_, tokens in r)]
    assert len(partial) >= 2, captured
