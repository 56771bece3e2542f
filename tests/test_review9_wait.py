"""Review 9: since 7bf2757 `wait()` turns a CancelledError into CheckpointSaveError ("the
background save ... was cancelled (close(), or the end of its event loop)") whenever the
background save is done by the time `wait()` resumes. It does not check that the save
itself was cancelled: a caller cancelled (its deadline, `asyncio.wait_for`) in the very turn
in which the save ended gets a false CheckpointSaveError instead of its cancellation, and
the save's result (committed) is dropped (held storage, no Ray)."""

from __future__ import annotations

import asyncio

import pytest
from _held_storage import Clock, Comp, Handle, held_rules, job  # noqa: F401

import forge_ckpt

pytestmark = pytest.mark.usefixtures("held_rules")


async def test_a_cancelled_wait_is_not_told_the_save_was_cancelled(tmp_path):
    """save(2) in async mode; a `wait()` is cancelled in the turn in which the background
    save commits (a done callback registered before `wait()`'s shield stands for a
    deadline firing in the same turn). The caller must see CancelledError (or the result),
    never a CheckpointSaveError saying the save was cancelled: step 2 committed."""
    a = job(tmp_path, Clock(), "host-a", async_mode="deferred")
    a.register("c0", Handle(Comp(1)))
    await a.save(2)
    pending = a._pending
    assert pending is not None and not pending.done()
    waiting = asyncio.ensure_future(a.wait())
    pending.add_done_callback(lambda _: waiting.cancel())  # runs before the shield's
    try:
        outcome: object = await waiting
    except BaseException as e:  # noqa: BLE001 (what the caller sees is the point)
        outcome = e
    assert not pending.cancelled() and pending.result().committed
    await a.aclose()
    on_disk = forge_ckpt.committed_steps(str(tmp_path))
    print(f"wait() -> {outcome!r}; committed {on_disk}")
    assert 2 in on_disk
    assert isinstance(outcome, asyncio.CancelledError), f"wait() raised {outcome!r}"


async def test_a_load_cancelled_as_the_background_save_ends_stops(tmp_path):
    """The same turn, for a load: `_settle` logs the false CheckpointSaveError and goes on,
    so a load cancelled by its caller (a deadline) runs to its end and returns; `asyncio.wait_for` would wait all that time past its deadline."""
    a = job(tmp_path, Clock(), "host-a", async_mode="deferred")
    comp = Comp(1)
    a.register("c0", Handle(comp))
    await a.save(2)
    pending = a._pending
    assert pending is not None and not pending.done()
    loading = asyncio.ensure_future(a.load())
    pending.add_done_callback(lambda _: loading.cancel())  # runs before the shield's
    try:
        outcome: object = await loading
    except BaseException as e:  # noqa: BLE001
        outcome = e
    await a.aclose()
    print(f"load() -> {outcome!r}")
    assert isinstance(outcome, asyncio.CancelledError), f"the cancelled load returned {outcome!r}"
