"""Review 7: without the memory tier, `wait()` and `aclose()` do not wait for the post-commit
task (`_follow`) of a save cancelled in its commit (`wait()` quiesces only with a tier): the
close that follows refuses that task's retention, which is skipped (held storage, no Ray)."""

from __future__ import annotations

import asyncio

import pytest
from _held_storage import Clock, Comp, Handle, held_rules, hold, job  # noqa: F401

import forge_ckpt

pytestmark = pytest.mark.usefixtures("held_rules")


async def test_aclose_waits_for_the_follow_task_of_a_save_cancelled_in_its_commit(tmp_path):
    """keep_last=1: save(1), then save(2) cancelled while its COMMIT is held (a slow
    storage call), let go at once. `aclose()` ("flush, then release") must leave only
    step 2: the follow task's retention removes step 1, unless close() cut it."""
    a = job(tmp_path, Clock(), "host-a", keep_last=1)
    a.register("c0", Handle(Comp(1)))
    await a.save(1)
    held = hold("create", "step-2/COMMIT")
    saving = asyncio.ensure_future(a.save(2))
    await held.reached()
    saving.cancel()
    held.go.set()
    with pytest.raises(asyncio.CancelledError):
        await saving
    await a.aclose()
    running_at_close = len(a._running)
    while a._running:  # the follow task runs on after close(): let it end
        await asyncio.sleep(0.01)
    steps = forge_ckpt.committed_steps(str(tmp_path))
    print(f"follow tasks running at close: {running_at_close}; committed steps {steps}")
    assert steps == [2], f"retention after step 2 did not run: {steps}"
