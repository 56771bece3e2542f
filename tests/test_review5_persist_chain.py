"""Review 5: the memory tier's chained persists (a save cancelled after pinning its step still
starts that step's persist, after the one before; none after close()). Each test holds one
call of the driver in its thread with a threading.Event (a slow S3 call, a slow holder) and
cancels a save there, as a caller's deadline does.

One node's local Ray; holders keep one copy (`memory_copies=1`).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from _held_storage import Clock
from _persist_holds import Counter, cancel_once_pinned, hold

from forge_ckpt import CheckpointConfig, CheckpointCoordinator
from forge_ckpt.coordination.runtime import Runtime
from forge_ckpt.steps import commit, layout

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def counter(ray_local):
    return Counter.remote()


def config(folder: str, memory_keep: int = 2) -> CheckpointConfig:
    return CheckpointConfig(folder=folder, memory_every=1, durable_every=1, memory_copies=1,
                            memory_keep=memory_keep)  # fmt: skip


PIN_HOLD_S = 10.0  # claim 3's hold, where no unpin comes to end it


async def until(cond: Any) -> None:
    for _ in range(12000):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never met")


async def test_cancelled_saves_behind_a_slow_persist_do_not_pile_up(counter, tmp_path, monkeypatch):
    """Claim 1: every due save cancelled in its wait for the persist before it now queues a
    persist of its own, chained after the last one, with its step pinned: in memory, kept
    out of memory retention and of the holders' room-making, until its turn. A caller whose
    deadline is shorter than one persist (S3 slow) adds one pinned step per save: nothing
    bounds the queue (before the change the saves waited: that was the backpressure)."""
    folder = str(tmp_path / "ckpt")
    coord = CheckpointCoordinator(config(folder, memory_keep=2))
    coord.register("counter", counter)
    entered, go = threading.Event(), threading.Event()
    real = commit.commit_step

    def held(store, manifest, *args):  # the persist of step 1 waits here (slow S3)
        if store is coord.store and manifest.step == 1:
            entered.set()
            assert go.wait(300)
        return real(store, manifest, *args)

    monkeypatch.setattr(commit, "commit_step", held)
    await counter.set.remote(1)
    await coord.save(1)
    assert await asyncio.to_thread(entered.wait, 300)
    try:
        for step in range(2, 8):
            await cancel_once_pinned(coord, counter, step)
        await coord._quiesce_calls()  # the last save's commit has set its persist going
        pinned, in_memory = sorted(coord.tier._pinned), coord.tier.steps()
    finally:
        go.set()
    await coord.wait()
    coord.close()
    print(f"pinned {pinned}, memory steps {in_memory} (memory_keep=2)")
    assert len(pinned) <= 2, f"{len(pinned)} persists queued, steps {pinned} pinned"
    assert len(in_memory) <= 2 + 2, f"memory steps {in_memory} kept with memory_keep=2"


async def test_close_stops_every_queued_persist_not_only_the_newest(counter, tmp_path, monkeypatch):
    """Claim 2: `cancel()` (close()) cancels `_persisting`, the newest link of the chain;
    the persist before it runs on. Here step 1's persist is in its holders' `has` call when
    close() comes (its lease not renewed for over half a TTL: a stalled driver, so the
    holders stay, they may be a successor's). After close() it goes on: the holders write
    step 1's files into the folder after the lease's release. Before the change the only
    persist in flight was `_persisting` and was cancelled: it wrote nothing."""
    folder = str(tmp_path / "ckpt")
    clock = Clock()
    coord = CheckpointCoordinator(config(folder), runtime=Runtime(wall=clock, lease_thread=False))
    coord.register("counter", counter)
    entered, go = threading.Event(), threading.Event()
    store = coord.tier.store
    real = store.on_all

    def held(
        method: str, *args: Any, **kw: Any
    ) -> Any:  # step 1's persist waits here (slow holder)
        if method == "has" and any(k.startswith("step-1/") for k in args[0]):
            entered.set()
            assert go.wait(300)
        return real(method, *args, **kw)

    monkeypatch.setattr(store, "on_all", held)
    await counter.set.remote(1)
    await coord.save(1)
    first = coord.tier._persisting
    assert await asyncio.to_thread(entered.wait, 300)
    try:
        await cancel_once_pinned(coord, counter, 2)  # its persist is queued behind step 1's
        clock.t += coord._lease.ttl_s * 0.6  # the driver stalled: not renewed for > ttl/2
        # the cancelled save's own call (its pin, in a thread) may still run on a busy
        # machine, and would rightly keep the lease until it ends: wait for it to end
        await until(lambda: coord._calls.busy == 0)
        coord.close()
        assert not coord._lease.held
        files_at_close = dict(coord.store.walk(layout.step_name(1)))
    finally:
        go.set()
    await until(first.done)
    await asyncio.sleep(0.5)
    after = dict(coord.store.walk(layout.step_name(1)))
    coord.tier.shutdown()
    written = sorted(set(after) - set(files_at_close))
    print(f"written into the folder after close(): {written}")
    assert not written, f"written into the folder after the lease's release: {written}"


async def test_a_save_cancelled_in_its_pin_call_leaves_no_pin_behind(
    counter, tmp_path, monkeypatch
):
    """Claim 3: a save cancelled while its pin call is in flight (a thread: it goes on) now
    starts its step's persist at once (no persist before it). That persist ends, unpins the
    step on the holders, and only then does the pin call land: the holders keep the step
    pinned for good (never dropped for room; the error of a full holder names it as waiting
    to be persisted; a later step of that number after a rollback is pinned too). The pin
    call is held until the unpin of step 2 has been answered; code that unpins only after
    the pin landed sends none meanwhile, and the hold ends after PIN_HOLD_S instead."""
    folder = str(tmp_path / "ckpt")
    coord = CheckpointCoordinator(config(folder))
    coord.register("counter", counter)
    entered, unpinned, landed = threading.Event(), threading.Event(), threading.Event()
    store = coord.tier.store
    real = store.on_all

    def held(
        method: str, *args: Any, **kw: Any
    ) -> Any:  # the pin of step 2 is slow (a slow holder)
        if method == "pin" and args == (2, True):
            entered.set()
            unpinned.wait(PIN_HOLD_S)
            try:
                return real(method, *args, **kw)
            finally:
                landed.set()
        try:
            return real(method, *args, **kw)
        finally:
            if method == "pin" and args == (2, False):
                unpinned.set()

    monkeypatch.setattr(store, "on_all", held)
    await counter.set.remote(1)
    await coord.save(1)
    await coord.wait()
    await counter.set.remote(2)
    saving = asyncio.ensure_future(coord.save(2))
    assert await asyncio.to_thread(entered.wait, 300)
    saving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await saving
    await coord.wait()  # step 2's persist ran and unpinned it
    assert coord.steps() == [1, 2]
    assert await asyncio.to_thread(landed.wait, 300)
    pins = {ref[1][:8]: info["pinned"] for ref, info in real("info")}
    coord.close()
    print(f"holders' pins after the persist of step 2 ended: {pins}")
    assert all(2 not in p for p in pins.values()), f"step 2 stays pinned on holders: {pins}"


@pytest.mark.parametrize("then", ["save", "load"])
async def test_a_save_cancelled_in_its_memory_commit_still_pins_and_persists_its_step(
    counter, tmp_path, monkeypatch, then
):
    """Claim 5: a save cancelled while its memory commit ran (a thread: it goes on and
    commits) skipped everything a commit sets going: the pin, the persist, retention. A
    retried save was told "already committed", and the step never became durable. The
    post-commit work is now a task of its own, which the next save or load waits for."""
    folder = str(tmp_path / "ckpt")
    coord = CheckpointCoordinator(config(folder))
    coord.register("counter", counter)
    entered, go = hold(monkeypatch, "commit_step", coord.tier.store, step=1)
    await counter.set.remote(1)
    saving = asyncio.ensure_future(coord.save(1))
    assert await asyncio.to_thread(entered.wait, 300)
    saving.cancel()
    go.set()
    with pytest.raises(asyncio.CancelledError):
        await saving
    if then == "save":
        assert (await coord.save(1)).committed  # the retry: "already committed"
    else:
        assert (await coord.load()).step == 1
    await coord.wait()
    durable, pinned = coord.steps(), set(coord.tier._pinned)
    coord.close()
    assert durable == [1], f"step 1 never persisted (durable steps {durable})"
    assert not pinned, f"steps {pinned} stay pinned"
