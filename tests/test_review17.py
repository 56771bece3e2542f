"""Review 17, of review 16's fixes (held storage, real threads):

1. Two event loops left open, used in turn: loop B's wait() looked while loop A's save was
   waiting for an actor; A then went into its commit, and its caller's deadline cancelled the
   save there. B's later load() and wait() waited forever for A's futures: the check for
   another open loop's work ran only on B's first look. It runs at every look now.
2. A load whose first storage call queued behind a busy executor worker when asyncio.run()
   ended: the call never ran, but the program kept its cancelled task, whose exception kept
   the call object alive, and with it the count of running calls: every later load waited
   out `save_timeout_s` and failed, and close() never released the lease. A call whose task
   is cancelled before a thread took it stops counting then.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from _held_storage import (  # noqa: F401
    WAIT_S,
    Clock,
    Comp,
    Handle,
    SlowReply,
    held_rules,
    hold,
    job,
)
from test_review15 import ActorHandle, landed  # noqa: F401

from forge_ckpt.errors import CheckpointError


def test_work_another_open_loop_started_after_this_loops_look_is_refused(
    tmp_path,
    held_rules,  # noqa: F811
    landed,  # noqa: F811
):
    a = job(tmp_path, Clock(), "host-a", keep_last=10)
    comp = SlowReply(1, step=2)
    a.register("c0", Handle(comp))
    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        first.run_until_complete(a.save(1))
        comp.version, comp.armed = 2, True
        saving = first.create_task(a.save(2))
        first.run_until_complete(asyncio.to_thread(comp.entered.wait, WAIT_S))
        assert second.run_until_complete(a.wait()) is None  # looks: nothing to refuse yet
        held = hold("create", "step-2/COMMIT")
        comp.go.set()
        first.run_until_complete(held.reached())  # the first loop's commit call runs
        saving.cancel()  # its caller's deadline
        first.run_until_complete(asyncio.wait([saving]))
        held.go.set()
        assert landed.wait(WAIT_S)  # its futures stay pending: the first loop is idle
        for call in (a.load, a.wait):
            with pytest.raises(CheckpointError, match="another event loop that is still open"):
                second.run_until_complete(asyncio.wait_for(call(), WAIT_S))
        first.run_until_complete(a.wait())  # back in the first loop, its work ends
        comp.version = 0
        loaded = second.run_until_complete(asyncio.wait_for(a.load(), WAIT_S))
        assert loaded is not None and loaded.step == 2 and comp.version == 2
    finally:
        comp.go.set()
        first.close()
        second.close()
        a.close()


def test_a_queued_call_of_a_cancelled_task_the_program_keeps_is_not_counted(
    tmp_path,
    held_rules,  # noqa: F811
):
    a = job(tmp_path, Clock(), "host-a", keep_last=10, save_timeout_s=WAIT_S)
    comp = Comp(1)
    a.register("c0", ActorHandle(comp))
    kept: list[asyncio.Task] = []  # the program keeps its tasks (as asyncio asks it to)
    go, holding = threading.Event(), threading.Event()

    async def first() -> None:
        loop, workers = asyncio.get_running_loop(), ThreadPoolExecutor(1)
        loop.set_default_executor(workers)
        await a.save(1)
        loop.run_in_executor(None, lambda: (holding.set(), go.wait(WAIT_S)))  # one busy worker
        while not holding.is_set():
            await asyncio.sleep(0)
        kept.append(loop.create_task(a.load()))  # its first storage call queues
        while not workers._work_queue.qsize():
            await asyncio.sleep(0)
        queued = next(f for f in a._running if not f.done())
        queued.add_done_callback(lambda _: go.set())  # asyncio.run's cancel frees the worker

    try:
        asyncio.run(first())  # ends: every task cancelled, the executor joined
        assert kept[0].cancelled()
        assert a._calls.busy == 0, "a call that never ran is counted as running"
        comp.version = 0
        loaded = asyncio.run(asyncio.wait_for(a.load(), WAIT_S))
        assert loaded is not None and loaded.step == 1 and comp.version == 1
    finally:
        go.set()
        a.close()
    job(tmp_path, Clock(), "host-b", keep_last=10).close()  # the lease was released
