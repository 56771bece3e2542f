"""Review 6: the memory tier's coalesced persists (at most one waits behind the running one;
a newer due step takes its turn). Two holes at the tier's level, where two due steps are
queued without the event loop running in between, or a load's `settle()` comes right after
a step was dropped. Each test holds the durable commit of step 1 in its thread (a slow S3
call) with a threading.Event, so that the persists behind it queue.

One node's local Ray; holders keep one copy (`memory_copies=1`).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from _persist_holds import Counter, hold

from forge_ckpt import CheckpointConfig, CheckpointCoordinator
from forge_ckpt.steps import layout

pytestmark = pytest.mark.asyncio(loop_scope="module")

UNPIN_HOLD_S = 5.0  # B's hold, where nothing but the settle() under test would end it


@pytest.fixture(scope="module")
def counter(ray_local):
    return Counter.remote()


async def queue_one(coord: CheckpointCoordinator, counter: Any, monkeypatch: Any) -> Any:
    """Step 1 committed in memory, its persist held at its durable commit. Returns the
    event that lets that commit go on."""
    entered, go = hold(monkeypatch, "commit_step", coord.store, step=1)
    await counter.set.remote(1)
    await coord.save(1)
    assert await asyncio.to_thread(entered.wait, 300)
    return go


async def queue_two(coord: CheckpointCoordinator, counter: Any, monkeypatch: Any) -> Any:
    """Steps 1-3 committed in memory; step 1's persist held at its durable commit, then
    steps 2 and 3 pinned and their persists started back to back: 3 takes 2's turn.
    Returns the event that lets step 1's commit go on."""
    go = await queue_one(coord, counter, monkeypatch)
    tier = coord.tier
    for step in (2, 3):
        await counter.set.remote(step)
        await coord.save(step, durable=False)
    for step in (2, 3):
        await asyncio.to_thread(tier.store.on_all, "pin", step, True)
        tier._pinned.add(step)
    manifests = [layout.read_committed(tier.store, s) for s in (2, 3)]
    for m in manifests:  # no await in between: 2's task never ran before 3 took its turn
        tier._start_persist(m, coord.store, coord._committer.commit, coord._committer.retention)
    return go


def pins(coord: CheckpointCoordinator) -> dict[str, Any]:
    return {ref[1][:8]: info["pinned"] for ref, info in coord.tier.store.on_all("info")}


async def test_a_persist_coalesced_before_it_ever_ran_unpins_its_step(
    counter, tmp_path, monkeypatch
):
    """A: the queued persist of step 2 was cancelled when step 3 took its turn; a task
    cancelled before its coroutine ever ran runs none of it, so step 2 stayed pinned on the
    holders for good (never dropped for room). It is now told it was superseded, and
    unpins its step itself."""
    coord = CheckpointCoordinator(CheckpointConfig(folder=str(tmp_path / "ckpt"),
                                  memory_every=1, durable_every=1, memory_copies=1))  # fmt: skip
    coord.register("counter", counter)
    go = await queue_two(coord, counter, monkeypatch)
    go.set()
    await coord.wait()
    durable, pinned = coord.steps(), await asyncio.to_thread(pins, coord)
    coord.close()
    assert durable == [1, 3]
    assert all(2 not in p for p in pinned.values()), f"step 2 stays pinned: {pinned}"


async def test_settle_waits_for_the_unpin_of_a_dropped_persist(counter, tmp_path, monkeypatch):
    """B: `settle()` (a load's first step) waited for the newest persist only, not for the
    unpin of the step a coalesced persist dropped. After a rollback, that late unpin
    unpins a new step of the same number. The unpin of step 2 is held until settle()
    returns (or UNPIN_HOLD_S): it must have landed first."""
    coord = CheckpointCoordinator(CheckpointConfig(folder=str(tmp_path / "ckpt"),
                                  memory_every=1, durable_every=1, memory_copies=1))  # fmt: skip
    coord.register("counter", counter)
    store, order, settled = coord.tier.store, [], threading.Event()
    real = store.on_all

    def held(method: str, *args: Any, **kw: Any) -> Any:
        if method == "pin" and args == (2, False):
            settled.wait(UNPIN_HOLD_S)
            try:
                return real(method, *args, **kw)
            finally:
                order.append("unpinned step 2")
        return real(method, *args, **kw)

    monkeypatch.setattr(store, "on_all", held)
    go = await queue_two(coord, counter, monkeypatch)
    go.set()
    await coord.tier.settle()
    order.append("settled")
    settled.set()
    await coord.wait()
    coord.close()
    assert order[0] == "unpinned step 2", f"settle() returned before the late unpin: {order}"


@pytest.mark.filterwarnings("ignore:The test <Function:pytest.PytestWarning")  # (not async)
def test_a_persist_cut_off_by_the_end_of_its_event_loop_unpins_its_step(
    counter, tmp_path, monkeypatch
):
    """C: a coordinator may serve several `asyncio.run()` calls in turn. The first one
    returned with the persist of step 1 in flight: its task was cancelled, nothing unpinned
    step 1, and the holders kept it pinned for good. It is unpinned now (and said), and the
    next loop's saves and persists go on."""
    coord = CheckpointCoordinator(CheckpointConfig(folder=str(tmp_path / "ckpt"),
                                  memory_every=1, durable_every=1, memory_copies=1))  # fmt: skip
    coord.register("counter", counter)
    go: list[threading.Event] = []

    async def first() -> None:  # returns while step 1's durable commit is held
        go.append(await queue_one(coord, counter, monkeypatch))

    async def second() -> tuple[list[int], dict[str, Any]]:
        await coord.wait()
        await counter.set.remote(2)
        await coord.save(2)
        await coord.wait()
        return coord.steps(), await asyncio.to_thread(pins, coord)

    loop = asyncio.new_event_loop()  # what asyncio.run(first()) does, with step 1's commit
    loop.run_until_complete(first())  # let go once the loop's end has cancelled its tasks
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    go[0].set()
    loop.run_until_complete(loop.shutdown_default_executor())
    loop.close()
    durable, pinned = asyncio.run(second())
    coord.close()
    assert durable[-1] == 2
    assert all(not p for p in pinned.values()), f"steps stay pinned: {pinned}"
