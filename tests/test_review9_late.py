"""Review 9: an owed commit was checked once (`run_owed` reads whether it landed) but nothing
made sure its thread had ended. A loop shut down without joining its executor (a runner that
cancels every task then calls `loop.close()`, not `asyncio.run`) cancelled the commit's
storage call (its future), the entry was owed, and the commit's thread ran on. The next
loop's `load()` read "not landed", dropped the entry and resumed step 1; then step 2's COMMIT
landed, and the new branch's save(2) was told "already committed" and saved nothing: load()
resumed the OLD step 2. A call cancelled that way now makes the next save or load wait for
every storage call still running (bounded by `save_timeout_s`) before it looks (held
storage, no Ray)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from _held_storage import HOLDS, RULES, Clock, Comp, Handle, hold, job, looking_at_calls

from forge_ckpt.errors import CheckpointError
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


def first_loop(a: Any, comp: Comp, held: Any) -> None:
    """save(1), then save(2), whose commit is held at its COMMIT when the loop is shut down."""

    async def first() -> None:
        await a.save(1)
        await a.wait()
        comp.version = 2
        await a.save(2)  # returns at the snapshots; the commit runs in `_pending`
        await held.reached()

    run_and_close(first)


@pytest.fixture
def held_job(tmp_path, monkeypatch):
    """A deferred job whose save(2) commit will be held at its COMMIT; the holds are let go
    and the job closed at the end, whatever the test did."""
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
    try:
        yield a, comp, held, landed
    finally:
        for h in HOLDS:
            h.go.set()
        RULES.clear()
        HOLDS.clear()
        a.close()


def test_a_load_waits_for_a_commit_its_shut_down_loop_left_running(held_job):
    a, comp, held, landed = held_job
    first_loop(a, comp, held)
    waiting = looking_at_calls(a)

    async def second() -> tuple[Any, Any]:
        load = asyncio.ensure_future(a.load())
        assert await asyncio.to_thread(waiting.wait, 60), "the load did not wait for the call"
        assert not load.done()
        held.go.set()  # the commit's thread goes on: its COMMIT lands while the load waits
        loaded = await load
        comp.version = 3
        saved = await a.save(3)
        await a.wait()
        return loaded, saved

    loaded, saved = asyncio.run(second())
    assert landed.is_set()
    assert loaded is not None and loaded.step == 2  # the step that landed, not step 1
    assert saved.committed and a.steps()[-2:] == [2, 3]


def test_a_call_still_running_past_the_bound_fails_the_load_and_decides_nothing(held_job):
    a, comp, held, landed = held_job
    first_loop(a, comp, held)
    a.config.save_timeout_s = 0.5  # the call is held by the test: it outlives any bound

    async def second() -> Any:
        with pytest.raises(CheckpointError, match=r"still runs after 0\.5 s") as e:
            await a.load()
        assert "retry once it ends" in str(e.value)
        assert comp.version == 2  # nothing loaded
        held.go.set()
        assert await asyncio.to_thread(landed.wait, 60)
        return await a.load()  # the retry reads what the commit left: step 2 landed

    loaded = asyncio.run(second())
    assert loaded is not None and loaded.step == 2
