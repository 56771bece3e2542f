"""Review 8: since 6e21956 `wait()` (and so `aclose()`) runs `_quiesce_calls` without a memory
tier too: it now waits for every storage call a save cancelled by its caller left running,
not only for a commit's follow-up. A save cancelled in `prepare_step` (a hung mount: local
storage has no call bound) makes `aclose()` block until that call ends, where before it
flushed nothing and returned (held storage, no Ray)."""

from __future__ import annotations

import asyncio

import pytest
from _held_storage import Clock, Comp, Handle, held_rules, hold, job  # noqa: F401

pytestmark = pytest.mark.usefixtures("held_rules")


async def test_aclose_does_not_wait_for_a_cancelled_saves_prepare(tmp_path):
    """save(2) cancelled while its `makedirs` of step-2 is held: no commit began, so there
    is nothing to flush. `aclose()` must return within a few turns of the event loop (no
    storage call of its own: close() releases the lease once the held call ends)."""
    a = job(tmp_path, Clock(), "host-a")
    a.register("c0", Handle(Comp(1)))
    await a.save(1)
    held = hold("makedirs", "step-2/actors")
    saving = asyncio.ensure_future(a.save(2))
    await held.reached()
    saving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await saving
    closing = asyncio.ensure_future(a.aclose())
    for _ in range(100):  # no thread hop is needed: aclose() has nothing to flush
        await asyncio.sleep(0)
    returned = closing.done()
    held.go.set()
    await closing
    print(f"aclose() returned while the cancelled save's call was held: {returned}")
    assert returned, "aclose() waits for a cancelled save's storage call (unbounded locally)"
