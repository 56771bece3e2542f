"""SIGKILL the saving process at each phase of the protocol; the previous step must survive.

The driver (crash_child.py) runs in its own process on this module's Ray cluster, commits
step 1, and is killed while saving step 2. This test then opens the folder as a restarted job
would: leftovers are removed, and load() restores the newest committed step intact.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import ray

from forge_ckpt import CheckpointConfig, CheckpointCoordinator
from forge_ckpt.steps import layout

sys.path.insert(0, os.path.dirname(__file__))
from crash_actors import Sampler, make_trainer_ranks  # noqa: E402

CHILD = os.path.join(os.path.dirname(__file__), "crash_child.py")

# phase -> (the step folders left after restart, the step that loads)
PHASES = {
    "before_trainer_write": ([1], 1),
    "after_trainer_write": ([1], 1),
    "after_first_actor_file": ([1], 1),
    "before_marker": ([1], 1),
    "after_marker": ([1], 1),  # COMMIT written, not yet recorded in the lease: a leftover
    "after_record": ([1, 2], 2),  # killed before retention: step 1 goes at the next save
    "during_retention": ([2], 2),  # step 1 lost its marker first: a leftover, removed
}


@pytest.mark.parametrize("phase", list(PHASES))
def test_kill_during_save(ray_local, tmp_path, phase):
    folder = str(tmp_path / "ckpt")
    address = ray.get_runtime_context().gcs_address
    ranks = 2
    proc = subprocess.run(
        [sys.executable, CHILD, address, folder, phase, str(ranks)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == -9, f"child was not killed:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "committed 1" in proc.stdout and "committed 2" not in proc.stdout
    left, want = PHASES[phase]
    with open(os.path.join(folder, "expected-1.json")) as f:
        expected = json.load(f)

    async def restart():
        coord = CheckpointCoordinator(CheckpointConfig(folder=folder, keep_last=1))
        assert layout.all_steps(folder) == left  # leftovers were removed at start-up
        samplers = [Sampler.remote(s) for s in (7, 8, 9)]
        coord.register("sampler", samplers[0])
        coord.register("buffer", samplers[1:])
        trainer = make_trainer_ranks(ranks, seed=5)
        coord.set_trainer(trainer)
        result = await coord.load()
        histories = [await s.get_history.remote() for s in samplers]
        weights = [await t.fingerprint.remote() for t in trainer]
        coord.close()
        for a in [*samplers, *trainer]:
            ray.kill(a)
        return result, histories, weights

    result, histories, weights = asyncio.run(restart())
    assert result.step == want
    if want == 1:
        assert histories == expected["samplers"] and weights == expected["trainer"]
    else:  # step 2 committed before the kill: one more draw each, and different weights
        assert [h[:1] for h in histories] == expected["samplers"]
        assert all(len(h) == 2 for h in histories) and weights != expected["trainer"]
