"""Cancellation and the one-save-or-load-at-a-time rule (review 4, held storage, no sleeps).

A caller's deadline on `save(N+1)`, `wait()` or `load()` cancelled the background part of
deferred save N: aborted before its commit with nothing raised, or committed with its outcome
and its retention lost. The background save is shielded now: it runs to its end and the next
`wait()` reports it. A coordinator may also serve several `asyncio.run()` calls in turn."""

from __future__ import annotations

import asyncio

import pytest
from _held_storage import Clock, Comp, Handle, held_rules, hold, job  # noqa: F401


async def _idle(coord) -> None:
    for _ in range(60000):
        if coord._calls.busy == 0 and not coord._running:
            return
        await asyncio.to_thread(lambda: None)
    raise AssertionError("never idle")


pytestmark = pytest.mark.usefixtures("held_rules")


async def _cancel_the_next_save(coord, held) -> None:
    """save(2), cancelled by its caller's deadline while it waits for save(1)'s background
    part (held at `held`), which is then let go."""
    nxt = asyncio.ensure_future(coord.save(2))
    for _ in range(50):  # as far as it gets: it waits for save(1)
        await asyncio.sleep(0)
    nxt.cancel()  # asyncio.wait_for(coord.save(2), t) timing out
    held.go.set()
    with pytest.raises(asyncio.CancelledError):
        await nxt


async def _deferred_save_1_cancelled_behind(tmp_path, op: str, path: str):
    """Deferred mode: save(1) returns with its `op` on `path` held in its thread; the
    caller's next save(2) is then cancelled by its deadline while it waits for save(1)."""
    a = job(tmp_path, Clock(), "host-a", keep_last=None, async_mode="deferred")
    a.register("c0", Handle(Comp(1)))
    held = hold(op, path)
    r1 = await a.save(1)
    assert not r1.committed
    await held.reached()
    await _cancel_the_next_save(a, held)
    return a


async def test_a_deadline_on_the_next_save_during_a_commit_keeps_its_outcome(tmp_path):
    """Deferred mode: save(1) returns (its commit in the background). The caller's next
    save(2) is cancelled by its deadline while save(2) waits for save(1)'s commit. That
    cancel went into save(1)'s task (an unshielded await), and wait() then returned None:
    save(1)'s outcome and its post-commit part were lost. Now wait() reports it."""
    a = await _deferred_save_1_cancelled_behind(tmp_path, "create", "step-1/COMMIT")
    flushed = await a.wait()
    await _idle(a)
    print(
        "wait() after the cancel returned",
        flushed,
        "steps",
        a.steps(),
        "on disk",
        sorted(p.name for p in tmp_path.rglob("COMMIT")),
    )
    # step 1 committed here (the COMMIT was in its thread), but its post-commit part
    # (retention, branch bookkeeping, memory persist) never ran and nobody was told.
    assert flushed is not None, "save(1)'s outcome was dropped: wait() returns None"
    a.close()


async def test_a_deadline_on_the_next_save_before_a_commit_never_aborts_it(tmp_path):
    """As above, but before save(1)'s commit (held in the actor's write): save(1) was aborted
    by save(2)'s caller's deadline and wait() raised nothing. Now save(1) goes on."""
    a = await _deferred_save_1_cancelled_behind(tmp_path, "writer", "")
    err = None
    try:
        await a.wait()
    except BaseException as e:  # noqa: BLE001
        err = e
    await _idle(a)
    print(
        "steps",
        a.steps(),
        "wait() raised",
        repr(err),
        "on disk",
        sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")),
    )
    assert 1 in a.steps() or err is not None, "save(1) vanished and no error says so"
    a.close()


def test_one_coordinator_across_two_asyncio_runs(tmp_path):
    """A coordinator used in one asyncio.run() and then another: `_op` (asyncio.Lock) is
    bound to the first loop once it was contended there."""
    a = job(tmp_path, Clock(), "host-a", keep_last=None)
    a.register("c0", Handle(Comp(1)))

    async def two(s: int) -> None:
        await asyncio.gather(a.save(s), a.save(s + 1))

    asyncio.run(two(1))
    try:
        asyncio.run(two(3))
    finally:
        a.close()
    assert a.steps() == [1, 2, 3, 4]


async def test_a_deadline_on_a_load_never_cancels_the_save_it_waits_for(tmp_path):
    """load() during a deferred save's background part waits for it (_settle -> wait()). A
    caller's deadline on that load cancels the save's background task itself: save(2) is
    aborted, and no later wait() or load() says so (its failure is never raised)."""
    a = job(tmp_path, Clock(), "host-a", keep_last=None, async_mode="deferred")
    a.register("c0", Handle(Comp(1)))
    await a.save(1)
    await a.wait()
    held = hold("writer", "")
    r2 = await a.save(2)
    assert not r2.committed
    await held.reached()
    loading = asyncio.ensure_future(a.load())
    for _ in range(50):
        await asyncio.sleep(0)
    loading.cancel()  # asyncio.wait_for(coord.load(), t) timing out
    held.go.set()
    with pytest.raises(asyncio.CancelledError):
        await loading
    err = None
    try:
        await a.wait()
    except BaseException as e:  # noqa: BLE001
        err = e
    await _idle(a)
    print("steps", a.steps(), "wait() raised", repr(err))
    assert 2 in a.steps() or err is not None, "save(2) vanished and no error says so"
    a.close()
