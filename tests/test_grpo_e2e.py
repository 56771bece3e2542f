"""apps/grpo end to end: a job SIGKILLed at several moments and restarted each time finishes
with metrics and weights bitwise equal to an uninterrupted run; SIGTERM commits and exits 0.

Every job is a real `python -m apps.grpo.main` process with its own local Ray; a kill takes
down its whole process group (driver, Ray, actors), as a preempted node would. Saves are
slowed (`FORGE_CKPT_FAULT=fsync:sleep=...`) so that "while a save is being written" is a
moment the test can hit.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from apps.grpo import chaos, plot
from apps.grpo.metrics import EventsLog
from forge_ckpt import committed_steps
from forge_ckpt.steps import layout

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "grpo_test.yaml")
SLOW = {"FORGE_CKPT_FAULT": "fsync:sleep=0.05"}
VARIANTS = {
    # between_saves is in the overlap and S3 runs; each kill here costs a job start (~30 s)
    "base": ([], ["during_save", "after_commit"]),
    "two_ranks": (["trainer.world_size=2"], ["during_save"]),
    # the stall-free cut too: a deferred save killed while the next step already runs
    "overlap": (
        ["overlap=true", "checkpoint.async_mode=deferred"],
        ["during_save", "between_saves"],
    ),
}


def run_to_end(
    run_dir: str, overrides: list[str], env: dict, log: str, config: str = CONFIG
) -> chaos.Job:
    job = chaos.Job(config, run_dir, overrides, env, log)
    assert job.wait(timeout=600) == 0, open(log).read()[-3000:]
    return job


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture
def references(grpo_reference):
    """`get(variant)`: the uninterrupted run of that variant (shared by the session)."""
    return lambda variant: grpo_reference(CONFIG, tuple(VARIANTS[variant][0]))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_killed_job_resumes_bitwise(references, tmp_path, variant):
    overrides, moments = VARIANTS[variant]
    ref = references(variant)
    run_dir = str(tmp_path / "run")
    folder = os.path.join(run_dir, chaos.CHECKPOINTS)
    previous = None
    for n, moment in enumerate(moments):
        job = chaos.Job(
            CONFIG, run_dir, overrides, SLOW | held(moment), str(tmp_path / f"start{n}.log")
        )
        if previous is not None:
            check_resumed(job, previous)
        kill = chaos.kill_at(job, run_dir, moment)
        assert kill is not None, f"job ended before the {moment} kill"
        if moment == "during_save":
            assert kill.during_save
        if moment == "between_saves":  # killed where it held: after an unsaved step's line
            assert kill.lines_at_kill == job.holding() and not kill.during_save
        previous = kill
    job = run_to_end(run_dir, overrides, {}, str(tmp_path / "last.log"))
    check_resumed(job, previous)
    assert layout.committed_steps(folder)[-1] == 12
    assert read(os.path.join(run_dir, chaos.METRICS)) == read(os.path.join(ref, chaos.METRICS))
    assert read(os.path.join(run_dir, chaos.WEIGHTS)) == read(os.path.join(ref, chaos.WEIGHTS))
    check_every_prompt_once_per_epoch(os.path.join(run_dir, chaos.METRICS))


def test_killed_job_on_s3_resumes_bitwise(references, tmp_path, s3_folder, monkeypatch):
    """The same kills with the checkpoints in a bucket on a real S3 server (SeaweedFS): the
    commit is a conditional create there, and nothing is renamed or stat'ed."""
    ref = references("base")
    env = s3_folder.server.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # this process lists the bucket; the job gets the same env
    overrides = [f"checkpoint.folder={s3_folder.url}"]
    run_dir = str(tmp_path / "run")
    previous = None
    for n, moment in enumerate(["during_save", "between_saves"]):
        job = chaos.Job(
            CONFIG, run_dir, overrides, SLOW | env | held(moment), str(tmp_path / f"s{n}.log")
        )
        if previous is not None:
            check_resumed(job, previous)
        previous = chaos.kill_at(job, run_dir, moment, folder=s3_folder.url)
        assert previous is not None, f"job ended before the {moment} kill"
        if moment == "between_saves":
            assert previous.lines_at_kill == job.holding() and not previous.during_save
    job = run_to_end(run_dir, overrides, env, str(tmp_path / "last.log"))
    check_resumed(job, previous)
    assert committed_steps(s3_folder.url)[-1] == 12
    assert not os.path.exists(os.path.join(run_dir, chaos.CHECKPOINTS))  # nothing went local
    assert read(os.path.join(run_dir, chaos.METRICS)) == read(os.path.join(ref, chaos.METRICS))
    assert read(os.path.join(run_dir, chaos.WEIGHTS)) == read(os.path.join(ref, chaos.WEIGHTS))


def held(moment: str) -> dict[str, str]:
    """A job to be killed between two saves holds there until killed (`chaos_hold`): the
    window between a step's line and the next save is short, and a busy machine's polls of
    an S3 folder can miss every one (the run ended first)."""
    return {chaos.CHAOS_HOLD: "between_saves"} if moment == "between_saves" else {}


def check_resumed(job: chaos.Job, kill: chaos.Kill) -> None:
    """The restart loaded the newest step committed at the kill (never a partial one) and
    redoes at most one checkpoint interval."""
    assert chaos.wait_until(job, lambda: job.resumed_from() is not None, 600, 0.05) or (
        job.resumed_from() is not None
    )
    newest = kill.committed_at_kill[-1] if kill.committed_at_kill else 0
    assert job.resumed_from() == newest
    assert kill.lines_at_kill - newest <= 2


def check_every_prompt_once_per_epoch(metrics: str, size: int = 24, batch: int = 4) -> None:
    """Across the resumes no prompt was skipped or repeated: each epoch is a permutation."""
    with open(metrics) as f:
        records = [r for r in map(json.loads, f) if "event" not in r]
    served = [i for r in records for i in r["rollout_prompt_ids"]]
    per_epoch = size // batch * batch
    for start in range(0, len(served) - per_epoch + 1, per_epoch):
        assert sorted(served[start : start + per_epoch]) == list(range(size))


def test_sigterm_commits_the_current_step_and_exits_0(references, tmp_path):
    ref = references("base")
    run_dir = str(tmp_path / "run")
    overrides = ["checkpoint.interval=5"]  # the step SIGTERM lands on is not a save step
    job = chaos.Job(CONFIG, run_dir, overrides, {}, str(tmp_path / "term.log"))
    assert chaos.wait_until(job, lambda: chaos.metrics_lines(run_dir) >= 2, 600, 0.001)
    os.kill(job.proc.pid, signal.SIGTERM)  # the driver only, as a scheduler's preemption notice
    assert job.wait(timeout=300) == 0
    lines = chaos.metrics_lines(run_dir)
    assert 2 <= lines < 12
    assert layout.committed_steps(os.path.join(run_dir, chaos.CHECKPOINTS))[-1] == lines
    assert f"SIGTERM: committed step {lines}" in read(job.log).decode()
    job = run_to_end(run_dir, overrides, {}, str(tmp_path / "again.log"))
    assert job.resumed_from() == lines
    assert read(os.path.join(run_dir, chaos.METRICS)) == read(os.path.join(ref, chaos.METRICS))
    assert read(os.path.join(run_dir, chaos.WEIGHTS)) == read(os.path.join(ref, chaos.WEIGHTS))
    loads = [
        e for e in EventsLog(os.path.join(run_dir, "events.jsonl")).read() if e["kind"] == "load"
    ]
    assert [(e["step"], e["outcome"]) for e in loads] == [(None, "skipped"), (lines, "loaded")]


def test_events_file_and_its_plot(references, tmp_path):
    """The uninterrupted run's events.jsonl: a committed save per checkpoint step with every
    component timed; the plot draws it."""
    ref = references("base")
    events = EventsLog(os.path.join(ref, "events.jsonl")).read()
    saves = [e for e in events if e["kind"] == "save"]
    assert [e["step"] for e in saves] == list(range(2, 13, 2))  # checkpoint.interval=2
    components = {"trainer", "dataset", "policy", "reward", "replay"}
    for e in saves:
        assert e["outcome"] == "committed" and e["tier"] == "durable" and e["nbytes"] > 0
        assert set(e["components"]) == components and e["seconds"] >= e["blocked_s"] > 0
    out = str(tmp_path / "plot.png")
    assert plot.main([ref, out]) == 0 and os.path.getsize(out) > 0


def test_sigterm_during_background_save_commits_and_exits_0(references, tmp_path):
    ref = references("base")
    run_dir = str(tmp_path / "run")
    folder = os.path.join(run_dir, chaos.CHECKPOINTS)
    overrides = ["checkpoint.async_mode=async"]
    job = chaos.Job(CONFIG, run_dir, overrides, SLOW, str(tmp_path / "term.log"))
    assert chaos.wait_until(job, lambda: chaos.saving(folder), 600, 0.001)
    os.kill(job.proc.pid, signal.SIGTERM)  # while a background save is being written
    assert job.wait(timeout=300) == 0
    lines = chaos.metrics_lines(run_dir)
    assert layout.committed_steps(folder)[-1] == lines and not chaos.saving(folder)
    job = run_to_end(run_dir, overrides, {}, str(tmp_path / "again.log"))
    assert job.resumed_from() == lines
    assert read(os.path.join(run_dir, chaos.METRICS)) == read(os.path.join(ref, chaos.METRICS))


def test_sigterm_grace_period_exceeded_exits_1_and_names_the_resume_step(tmp_path):
    run_dir = str(tmp_path / "run")
    folder = os.path.join(run_dir, chaos.CHECKPOINTS)
    very_slow = {"FORGE_CKPT_FAULT": "fsync:sleep=1.0"}  # a save takes far longer than 2 s
    job = chaos.Job(
        CONFIG, run_dir, ["checkpoint.sigterm_grace_s=2"], very_slow, str(tmp_path / "term.log")
    )
    assert chaos.wait_until(job, lambda: bool(layout.committed_steps(folder)), 600, 0.01)
    assert chaos.wait_until(job, lambda: chaos.saving(folder), 600, 0.001)
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.wait(timeout=120) == 1
    newest = layout.committed_steps(folder)[-1]
    assert (
        f"no commit within the grace period of 2s; exiting. The newest committed step is {newest}"
    ) in read(job.log).decode()
    job.kill()  # its Ray processes
