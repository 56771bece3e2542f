"""Review 16, of review 15's fixes (held storage, real threads):

1. A storage call counted at submission whose task never started (its event loop closed
   after one iteration) kept the count up: every later load waited out `save_timeout_s` and
   failed, and close() never released the lease. A call is now counted from the step that
   hands it to a thread.
2. A save in a loop left idle mid-save (an actor's late reply), then a save of the same step
   from a new loop: the new loop's save was not refused, both reported "committed", and the
   first loop's commit then replaced the second's manifest and COMMIT over its files (the
   step no longer loaded). A save or load under way in another open loop is now refused.
"""

from __future__ import annotations

import asyncio

import pytest
from _held_storage import WAIT_S, Clock, Comp, Handle, SlowReply, held_rules, job  # noqa: F401

from forge_ckpt.errors import CheckpointError


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited")  # (its task never ran)
def test_a_call_whose_task_never_started_is_not_counted(tmp_path, held_rules):  # noqa: F811
    a = job(tmp_path, Clock(), "host-a", keep_last=10, save_timeout_s=WAIT_S)
    comp = Comp(1)
    a.register("c0", Handle(comp))
    asyncio.run(a.save(1))
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(a.load())  # its first step submits a storage call ...
        loop.call_soon(loop.stop)  # ... whose own task the loop never starts
        loop.run_forever()
        assert not task.done() and a._running, "the load did not reach its first call"
    finally:
        loop.close()
    try:
        assert a._calls.busy == 0, "a call that never started is counted as running"
        comp.version = 0
        loaded = asyncio.run(asyncio.wait_for(a.load(), WAIT_S))
        assert loaded is not None and loaded.step == 1 and comp.version == 1
    finally:
        a.close()
    b = job(tmp_path, Clock(), "host-a", keep_last=10)  # the lease was released
    b.close()
    del task


def test_a_save_under_way_in_an_idle_loop_refuses_another_loops_save(tmp_path, held_rules):  # noqa: F811
    a = job(tmp_path, Clock(), "host-a", keep_last=10)
    comp = SlowReply(1, step=4)
    a.register("c0", Handle(comp))
    first = asyncio.new_event_loop()
    try:
        first.run_until_complete(a.save(1))
        comp.version, comp.armed = 40, True
        saving = first.create_task(a.save(4))
        first.run_until_complete(asyncio.to_thread(comp.entered.wait, WAIT_S))
        # The first loop is idle now, its save(4) waiting for the actor's reply.
        comp.version = 41
        with pytest.raises(CheckpointError, match="another event loop that is still open"):
            asyncio.run(asyncio.wait_for(a.save(4), WAIT_S))
        comp.go.set()
        assert first.run_until_complete(saving).committed
        comp.version = 0
        loaded = asyncio.run(asyncio.wait_for(a.load(step=4), WAIT_S))
        assert loaded is not None and loaded.step == 4 and comp.version == 40
    finally:
        comp.go.set()
        first.close()
        a.close()
    b = job(tmp_path, Clock(), "host-b", keep_last=10)  # the next job resumes step 4, whole
    comp2 = Comp(0)
    b.register("c0", Handle(comp2))
    try:
        loaded = asyncio.run(asyncio.wait_for(b.load(), WAIT_S))
        assert loaded is not None and loaded.step == 4 and comp2.version == 40
    finally:
        b.close()
