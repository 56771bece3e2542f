"""Review 9: an owed commit is checked once (`run_owed` reads whether it landed) but nothing
makes sure its thread has ended: a loop closed without joining its executor (a runner that
calls `loop.close()`, not `asyncio.run`) cancels the commit's asyncio futures, the entry is
owed, and the commit's thread runs on. The next loop's `load()` reads "not landed", drops the
entry and resumes step 1; then step 2's COMMIT lands. The new branch's save(2) is told
"already committed" and saves nothing: load() resumes the OLD step 2 (held storage, no Ray)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from _held_storage import HOLDS, RULES, Clock, Comp, Handle, hold, job

from forge_ckpt.steps import commit


def run_and_close(main: Any) -> None:
    """Run `main`, cancel what is left (as asyncio.run does), close the loop without
    waiting for its executor's threads (`loop.close()` shuts it down with wait=False)."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
    finally:
        loop.close()


@pytest.mark.xfail(
    strict=True,
    reason="open (issue 22): an owed commit whose thread outlives its loop (loop.close() without "
    "joining the executor) can land after the next loop's check; asyncio.run() joins it first",
)
def test_a_commit_landing_after_the_owed_check(tmp_path, monkeypatch):
    real, landed = commit.commit_step, threading.Event()

    def noted(store: Any, manifest: Any, *args: Any) -> Any:
        try:
            return real(store, manifest, *args)
        finally:
            if manifest.step == 2:
                landed.set()

    monkeypatch.setattr(commit, "commit_step", noted)
    a = job(tmp_path, Clock(), "host-a", async_mode="deferred", keep_last=10)
    comp = Comp(1)
    a.register("c0", Handle(comp))
    RULES.clear()
    HOLDS.clear()
    held = hold("create", "step-2/COMMIT")

    async def first() -> None:
        await a.save(1)
        await a.wait()
        comp.version = 2
        await a.save(2)  # returns at the snapshots; the commit runs in `_pending`
        await held.reached()

    async def second() -> tuple[Any, Any, Any]:
        loaded = await a.load()  # a recovery: step 2's entry is owed, not landed yet
        owed = [m.step for m, *_ in getattr(a, "_follow_ups", a).__dict__.get("owed", [])]
        held.go.set()
        assert await asyncio.to_thread(landed.wait, 60)
        comp.version = 20  # the state trained again from step 1
        saved = await a.save(2)
        await a.wait()
        comp.version = -1
        again = await a.load()
        return loaded, (owed, saved.committed), again

    try:
        run_and_close(first)
        loaded, (owed, committed), again = asyncio.run(second())
    finally:
        for h in HOLDS:
            h.go.set()
        RULES.clear()
        HOLDS.clear()
        a.close()
    print(f"recovery load -> step {loaded and loaded.step} (owed left {owed}); save(2) "
          f"committed={committed}; load() -> step {again and again.step} version {comp.version}")  # fmt: skip
    assert again is not None and again.step == 2
    assert comp.version == 20, f"save(2) of the resumed run saved nothing: version {comp.version}"
