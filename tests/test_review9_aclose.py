"""Review 9: `aclose()` after a loop whose end cut off a background save in its commit (the
commit lands: `asyncio.run` joins the thread). The follow-up is owed; `wait()` raises the new
CheckpointSaveError before it runs `run_owed`, so `aclose()` releases the lease without it:
retention (here keep_last=1) never runs, and with the memory tier the step's pin and persist
would be lost the same way. The error says "the next save or load finishes what that sets
going", but aclose() is the last call (held storage, no Ray)."""

from __future__ import annotations

import asyncio
from typing import Any

from _held_storage import HOLDS, RULES, Clock, Comp, Handle, job
from _owed_faults import commit_cut_by_the_loop, release_holds

import forge_ckpt


def test_aclose_runs_an_owed_follow_up(tmp_path):
    a = job(tmp_path, Clock(), "host-a", async_mode="deferred", keep_last=1)
    a.register("c0", Handle(Comp(1)))
    RULES.clear()
    HOLDS.clear()

    async def second() -> Any:
        owed = [m.step for m, *_ in a._follow_ups.owed]
        try:
            await a.aclose()
        except BaseException as e:  # noqa: BLE001 (what escapes is reported)
            return owed, e
        return owed, None

    try:
        asyncio.run(commit_cut_by_the_loop(a))
        owed, raised = asyncio.run(second())
    finally:
        release_holds(a)
    on_disk = forge_ckpt.committed_steps(str(tmp_path))
    print(f"owed before aclose(): {owed}; aclose() -> {raised!r}; committed {on_disk}")
    assert 2 in on_disk
    assert on_disk == [2], f"step 2's retention (keep_last=1) never ran: {on_disk}"
