"""Review 8: a coordinator serving several `asyncio.run()` calls in turn (held storage, no
Ray). A deferred save whose background part (here its COMMIT, held in its thread) is cut off
by the end of the first loop leaves `_pending` cancelled; the second loop's first `load()`
(a recovery) then raises a bare CancelledError out of `wait(persisting=False)`, which
`_settle` does not catch (`except Exception`). Also on 8c7e16e (before 6e21956)."""

from __future__ import annotations

import asyncio
from typing import Any

from _held_storage import HOLDS, RULES, Clock, Comp, Handle, job
from _owed_faults import commit_cut_by_the_loop, release_holds


def test_the_next_loops_recovery_load_survives_a_save_cut_off_by_the_last_loop(tmp_path):
    a = job(tmp_path, Clock(), "host-a", async_mode="deferred")
    a.register("c0", Handle(Comp(1)))
    RULES.clear()
    HOLDS.clear()

    async def second() -> Any:
        try:
            return await a.load()
        except BaseException as e:  # noqa: BLE001 (what escapes is the finding)
            return e

    try:
        asyncio.run(commit_cut_by_the_loop(a))
        loaded = asyncio.run(second())
    finally:
        release_holds(a)
    print(f"the second loop's first load(): {loaded!r}")
    assert not isinstance(loaded, BaseException), f"load() raised {type(loaded).__name__}"
    assert loaded is not None and loaded.step == 2
