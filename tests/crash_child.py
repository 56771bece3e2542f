"""A driver that saves step 1, then is SIGKILLed at one phase of saving step 2.

Run by tests/test_crash.py as `python crash_child.py RAY_ADDRESS FOLDER PHASE TRAINER_RANKS`.
It joins the test's Ray cluster, so the actors it owns die with it, like a preempted job's.
The kill points are set by wrapping forge_ckpt's own functions in this process only.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import ray

sys.path.insert(0, os.path.dirname(__file__))
from crash_actors import Sampler, make_trainer_ranks  # noqa: E402

from forge_ckpt import CheckpointConfig, CheckpointCoordinator  # noqa: E402
from forge_ckpt.coordination import components as comp_mod  # noqa: E402
from forge_ckpt.storage.local import LocalStorage  # noqa: E402


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(phase: str) -> None:
    real_begin, real_status = comp_mod.RemoteUnit.begin, comp_mod.RemoteUnit.status
    real_create, real_delete_prefix = LocalStorage.create, LocalStorage.delete_prefix
    real_replace = LocalStorage.replace
    seen_files: list[str] = []

    async def begin(self, step_dir, background, defer=False, attempt=None):
        if phase == "before_trainer_write" and self.name == "trainer":
            die()
        return await real_begin(self, step_dir, background, defer, attempt)

    async def status(self):
        recs = await real_status(self)
        if recs is not None:
            if phase == "after_trainer_write" and self.name == "trainer":
                die()
            seen_files.extend(r.path for r in recs)
            if phase == "after_first_actor_file" and any(
                p.startswith("actors/") for p in seen_files
            ):
                die()
        return recs

    def create(self, path, data):
        if phase == "before_marker" and path.endswith("COMMIT"):
            die()
        tag = real_create(self, path, data)
        if phase == "after_marker" and path.endswith("COMMIT"):
            die()
        return tag

    def replace(self, path, data, tag):  # the lease write that records step 2: the commit point
        tag = real_replace(self, path, data, tag)
        if phase == "after_record" and "2" in json.loads(data).get("committed", {}):
            die()
        return tag

    def delete_prefix(self, prefix):  # retention: the marker of the old step is already gone
        if phase == "during_retention" and prefix == "step-1":
            die()
        return real_delete_prefix(self, prefix)

    comp_mod.RemoteUnit.begin, comp_mod.RemoteUnit.status = begin, status
    LocalStorage.create, LocalStorage.delete_prefix = create, delete_prefix
    LocalStorage.replace = replace


async def main(folder: str, phase: str, ranks: int) -> None:
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder, keep_last=1))
    samplers = [Sampler.remote(s) for s in (1, 2, 3)]
    coord.register("sampler", samplers[0])
    coord.register("buffer", samplers[1:])
    trainer = make_trainer_ranks(ranks) if ranks else []
    if trainer:
        coord.set_trainer(trainer)
    for step in (1, 2):
        await asyncio.gather(*(s.step.remote() for s in samplers))
        await asyncio.gather(*(t.train_step.remote() for t in trainer))
        if step == 2:
            install(phase)
        await coord.save(step)
        states = {
            "samplers": [await s.get_history.remote() for s in samplers],
            "trainer": [await t.fingerprint.remote() for t in trainer],
        }
        with open(os.path.join(folder, f"expected-{step}.json"), "w") as f:
            json.dump(states, f)
        print(f"committed {step}", flush=True)
    print("finished without being killed", flush=True)


if __name__ == "__main__":
    ray.init(address=sys.argv[1])
    asyncio.run(main(sys.argv[2], sys.argv[3], int(sys.argv[4])))
