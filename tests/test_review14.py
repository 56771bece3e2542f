"""Review 14, claim 1: a memory tier's persist whose task is cancelled while its durable COMMIT
is being written (every task cancelled, as a runner shutting a loop down does; the thread
runs on) was not waited for: nothing marked the coordinator, so the next load decided before
that COMMIT landed and resumed step 1; then durable step 2 landed, the new timeline's save(2)
found it there and never persisted its own, and once memory was lost a load returned the old
timeline's step 2. A load now waits, once the persists are settled, for any storage call of
the coordinator still running (simulated: the real tier and holders, virtual time)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("greenlet")

from test_sim_memory import Job, world  # noqa: E402,F401

from forge_ckpt.sim.loop import SimThread, run_io  # noqa: E402
from forge_ckpt.steps import commit  # noqa: E402

HOLD_S = 5.0  # virtual seconds, well under the lease's TTL


def test_a_load_waits_for_a_persist_commit_its_cancelled_task_left_running(
    world,  # noqa: F811
    monkeypatch,
):
    a = Job(world, "jobA", durable_every=1)
    real, held = commit.commit_step, []

    def slow_durable_commit(store: Any, manifest: Any, *args: Any) -> Any:
        th = SimThread.current()
        if manifest.step == 2 and store is a.coord.store and not held and th is not None:
            held.append(world.loop.time())
            th.pause(world.loop, HOLD_S)  # the durable COMMIT is slow (S3, say)
            held.append(world.loop.time())
        return real(store, manifest, *args)

    monkeypatch.setattr(commit, "commit_step", slow_durable_commit)
    assert a.run(a.coord.save(1)).committed
    a.run(a.coord.wait())
    assert a.run(a.coord.save(2)).committed  # in memory; its persist runs in the background

    async def until_held() -> None:
        while not held:
            await asyncio.sleep(0.001)

    a.run(until_held())
    left = [t for t in asyncio.all_tasks(world.loop) if not t.done()]
    for t in left:  # every task cancelled; the persist's commit thread runs on
        t.cancel()
    world.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
    assert a.coord._calls.busy > 0 and len(held) == 1  # (the persist's commit call runs on)
    a.run(run_io(commit.remove_step, a.coord.tier.store, 2))  # step 2's memory copy is lost

    loaded = a.run(a.coord.load())
    assert len(held) == 2, "the load decided before the persist's COMMIT of step 2 landed"
    assert loaded is not None and loaded.step == 2 and loaded.tier == "durable"
