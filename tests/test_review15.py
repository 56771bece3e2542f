"""Review 15: three ways an event loop that ends without asyncio.run() left a coordinator's
work behind, and the next loop either decided too early or waited forever.

1. A commit call queued behind busy executor workers (submitted, not yet running) was not
   counted as running: the next loop's load decided "not landed", resumed step 1, and the
   queued COMMIT of step 2 landed after (held storage, real threads). Calls now count from
   their submission.
2. A memory tier's persist in a loop closed without cancelling it never ends: load(), wait()
   and the next save waited for it forever (simulated: the real tier and holders, virtual
   time). Such a persist is dropped as one cut off by its loop's end is.
3. A first loop left open and idle: the next loop's load() waited forever for its futures. It
   now says what to do.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from _held_storage import WAIT_S, Clock, Comp, held_rules, hold, job, looking_at_calls  # noqa: F401

from forge_ckpt.errors import CheckpointError
from forge_ckpt.steps import commit

pytest.importorskip("greenlet")  # claim 2 runs in the simulation

from test_sim_memory import Job, world  # noqa: E402,F401

from forge_ckpt.memory.tier import MemoryTier  # noqa: E402
from forge_ckpt.sim.loop import SimLoop  # noqa: E402

ACTORS = ThreadPoolExecutor(4)  # the actors' threads: not the driver loop's executor


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> asyncio.Future:
        return asyncio.wrap_future(ACTORS.submit(self.fn, *args))


class ActorHandle:
    """A Ray-like handle whose calls run in threads of their own, as an actor's do."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._obj, name))


@pytest.fixture
def landed(monkeypatch) -> threading.Event:
    """Set once step 2's commit has run."""
    real, done = commit.commit_step, threading.Event()

    def noted(store: Any, manifest: Any, *args: Any) -> Any:
        try:
            return real(store, manifest, *args)
        finally:
            if manifest.step == 2:
                done.set()

    monkeypatch.setattr(commit, "commit_step", noted)
    return done


def test_a_commit_queued_behind_busy_workers_is_waited_for(tmp_path, held_rules, landed):  # noqa: F811
    a = job(tmp_path, Clock(), "host-a", keep_last=10, async_mode="deferred")
    comp = Comp(1)
    a.register("c0", ActorHandle(comp))
    loop, workers, go = asyncio.new_event_loop(), ThreadPoolExecutor(1), threading.Event()
    loop.set_default_executor(workers)  # one worker, soon busy with the driver's own call

    async def first() -> None:
        await a.save(1)
        await a.wait()
        comp.version = 2
        await a.save(2)  # deferred: its commit runs in the background
        loop.run_in_executor(None, go.wait, WAIT_S)  # the driver's blocking call
        while not (any(not f.done() for f in a._running) and workers._work_queue.qsize()):
            await asyncio.sleep(0)  # until step 2's commit call is queued behind it

    try:
        loop.run_until_complete(asyncio.wait_for(first(), WAIT_S))
        loop.close()  # nothing cancelled: the queued commit runs once the worker is free
        looked = looking_at_calls(a)

        async def second() -> Any:
            loading = asyncio.ensure_future(a.load())
            assert await asyncio.to_thread(looked.wait, WAIT_S), "the load never looked"
            assert not landed.is_set()
            go.set()  # the load waits for the queued commit: let it run
            return await loading

        loaded = asyncio.run(second())
        assert landed.is_set(), "the load decided before step 2's COMMIT landed"
        assert loaded is not None and loaded.step == 2 and comp.version == 2
    finally:
        go.set()
        a.close()


def test_a_persist_left_by_a_closed_loop_is_dropped_not_waited_for(world, monkeypatch):  # noqa: F811
    writing: list[int] = []
    real = MemoryTier._holders_write

    async def noted(self: Any, manifest: Any, spec: Any) -> Any:
        writing.append(manifest.step)
        return await real(self, manifest, spec)

    monkeypatch.setattr(MemoryTier, "_holders_write", noted)
    a = Job(world, "jobA", durable_every=1)
    assert a.run(a.coord.save(1)).committed  # memory step 1; its persist runs on

    async def until_writing() -> None:
        while not writing:
            await asyncio.sleep(0.001)

    a.run(until_writing())
    world.loop.close()  # nothing cancelled: the persist's task never runs again
    world.loop = SimLoop(world.clock)
    bound = 4 * a.config.save_timeout_s  # virtual seconds: before, each waited forever
    loaded = a.run(asyncio.wait_for(a.coord.load(), bound))
    assert loaded is not None and loaded.step == 1 and loaded.tier == "memory"
    a.run(asyncio.wait_for(a.coord.wait(), bound))
    assert a.run(asyncio.wait_for(a.coord.save(2), bound)).committed
    a.run(asyncio.wait_for(a.coord.wait(), bound))
    assert a.coord.tier is not None and not a.coord.tier.in_flight


def test_a_first_loop_left_open_is_named_not_waited_for(tmp_path, held_rules, landed):  # noqa: F811
    a = job(tmp_path, Clock(), "host-a", keep_last=10, async_mode="deferred")
    comp = Comp(1)
    a.register("c0", ActorHandle(comp))
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(a.save(1))
        loop.run_until_complete(a.wait())
        held = hold("create", "step-2/COMMIT")
        comp.version = 2
        loop.run_until_complete(a.save(2))
        loop.run_until_complete(held.reached())
        held.go.set()  # its thread ends while the loop is idle: the future stays pending
        assert landed.wait(WAIT_S)

        async def second() -> Any:
            return await asyncio.wait_for(a.load(), WAIT_S)

        with pytest.raises(CheckpointError, match="another event loop that is still open"):
            asyncio.run(second())
        loop.run_until_complete(a.wait())  # back in its own loop, the save ends
        comp.version = 0
        loaded = asyncio.run(second())
        assert loaded is not None and loaded.step == 2 and comp.version == 2
    finally:
        loop.close()
        a.close()
