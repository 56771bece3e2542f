"""Review 11: the fixes of review 10, attacked.

Claim 6: a wait() cancelled while it ran the owed follow-ups, before it raised a background
save's failure, dropped that failure (the next wait() returned as if it had saved).
Claim 5: a loop closed during a background save's commit left futures of that loop that the
next loop's wait(), save() and load() waited for forever.
Claim 7: an owed memory commit settled after a node joined (the tier's store object replaced)
was treated as a durable one: never pinned nor persisted.
(Claims 1-3, a record dropped from the lease, are in test_review10_owed.py.)
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from _held_storage import (  # noqa: F401
    HOLDS,
    RULES,
    Clock,
    Comp,
    Handle,
    fail,
    held_config,
    held_rules,
    hold,
    job,
    looking_at_calls,
)
from _owed_faults import failing_looks, lose_replies, wait_cancelled_in_its_look

import forge_ckpt
from forge_ckpt import CheckpointCoordinator, CheckpointSaveError
from forge_ckpt.coordination import follow_ups

pytestmark = pytest.mark.usefixtures("held_rules")


async def test_a_cancelled_wait_drops_the_background_failure(tmp_path, monkeypatch):
    a = job(tmp_path, Clock(), "host-a", keep_last=10, async_mode="deferred")
    a.register("c0", Handle(Comp(1)))
    await a.save(1)
    await a.wait()
    lose_replies(monkeypatch, {2})  # step 2 lands, its reply is lost: owed
    await a.save(2)
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        await a.wait()
    failing_looks(monkeypatch, 1)  # save(3)'s look at 2 fails: 2 stays owed
    fail("create", "step-3/manifest.json")  # step 3 fails for real: not committed
    await a.save(3)
    await asyncio.sleep(0)
    await wait_cancelled_in_its_look(a, monkeypatch)
    try:
        second: object = await a.wait()
    except CheckpointSaveError as e:
        second = f"raised: {e}"[:120]
    on_disk = forge_ckpt.committed_steps(str(tmp_path))
    await a.aclose()
    print(f"\nthe next wait() -> {second!r}; committed {on_disk}")
    assert 3 not in on_disk
    assert isinstance(second, str), "step 3's failure was dropped: wait() returned as if saved"


BOUND_S = 60.0  # a hang detector: these calls take milliseconds (never a race)


def test_a_loop_closed_in_the_commit_of_a_deferred_save(tmp_path):
    RULES.clear()
    HOLDS.clear()
    coord = CheckpointCoordinator(held_config(tmp_path, async_mode="deferred"))
    coord.register("c0", Handle(Comp(1)))
    held = hold("create", "step-1/COMMIT")
    loop = asyncio.new_event_loop()
    loop.run_until_complete(coord.save(1))  # returns at the snapshots
    loop.run_until_complete(held.reached())  # the background commit waits at its COMMIT
    loop.close()  # the loop ends (as in review 10 F) while the commit's thread runs
    held.go.set()  # the COMMIT lands; the thread's result has no loop to go to
    outcomes = []
    for name, call in (("wait", coord.wait), ("save", lambda: coord.save(2)),
                       ("load", coord.load)):  # fmt: skip
        try:
            got = asyncio.run(asyncio.wait_for(call(), BOUND_S))
            outcomes.append((name, repr(got)[:80]))
        except BaseException as e:  # noqa: BLE001
            outcomes.append((name, f"{type(e).__name__}: {e}"[:140]))
    stuck = [
        (name, sum(t.get_loop().is_closed() for t in tasks))
        for name, tasks in (("_running", coord._running), ("tasks", coord._follow_ups.tasks))
    ]
    outcomes.append(("futures of the closed loop still waited for", str(stuck)))
    coord.close()
    RULES.clear()
    HOLDS.clear()
    print("\n" + "\n".join(f"{n}: {o}" for n, o in outcomes))
    assert not any(o.startswith("TimeoutError") for _, o in outcomes), (
        f"a call waited past {BOUND_S} s for a closed loop's futures: {outcomes}"
    )


async def test_a_load_whose_record_write_fails_decides_nothing(tmp_path):
    """Review 12, claim 1: step 2's record write fails, then so does the load's write of the
    lease's record (settle_record). The load used to drop the entry and resume step 1; the
    next renewal then recorded step 2, and a save(2) of the resumed job was told "already
    committed" without writing. The load now fails and names why; the next load decides."""
    a = job(tmp_path, Clock(), "host-a", keep_last=10)
    comp = Comp(1)
    a.register("c0", Handle(comp))
    assert (await a.save(1)).committed
    comp.version = 2
    fail("replace", ".forge_ckpt.lease", times=2)  # the record write of 2, then the load's
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        await a.save(2)
    comp.version = -1
    with pytest.raises(forge_ckpt.CheckpointError, match="retry the load"):
        await a.load()
    assert comp.version == -1, "a load that failed applied something"
    loaded = await a.load()  # the record write goes through now
    listed = forge_ckpt.committed_steps(str(tmp_path))
    a._lease.renew()
    after = forge_ckpt.committed_steps(str(tmp_path))
    await a.aclose()
    assert loaded is not None and (loaded.step, comp.version) == (listed[-1], listed[-1])
    assert after == listed, "a renewal changed the steps the load chose from"


def test_a_closed_loops_commit_that_lands_after_the_next_load_began(tmp_path):
    """Review 12, claim 2: a loop closed (no asyncio.run()) while a deferred save's commit
    waited at its COMMIT; the next loop's load read step 2 as not landed and resumed step 1,
    then the old thread's COMMIT landed, and a later save(2) of other state was told
    "committed" without writing. A call now waits for such a thread before anyone looks."""
    RULES.clear()
    HOLDS.clear()
    a = job(tmp_path, Clock(), "host-a", keep_last=10, async_mode="deferred")
    comp = Comp(1)
    a.register("c0", Handle(comp))
    loop = asyncio.new_event_loop()
    loop.run_until_complete(a.save(1))
    loop.run_until_complete(a.wait())
    comp.version = 2
    held = hold("create", "step-2/COMMIT")
    loop.run_until_complete(a.save(2))
    loop.run_until_complete(held.reached())
    loop.close()  # nothing cancelled: the commit's thread waits at its COMMIT
    waiting = looking_at_calls(a)

    async def load_beside_the_thread() -> object:
        comp.version = -1
        load = asyncio.ensure_future(a.load())
        waits = asyncio.ensure_future(asyncio.to_thread(waiting.wait, BOUND_S))
        await asyncio.wait([load, waits], return_when=asyncio.FIRST_COMPLETED)
        assert not load.done(), f"the load decided while the commit's thread ran: {load}"
        held.go.set()  # the old loop's commit goes on: its COMMIT lands
        return await load

    try:
        got = asyncio.run(asyncio.wait_for(load_beside_the_thread(), BOUND_S))
        assert got is not None and got.step == 2 and comp.version == 2, got
    finally:
        held.go.set()
        a.close()
        RULES.clear()
        HOLDS.clear()


def test_a_loop_closed_while_a_wait_looked_keeps_the_entry(tmp_path, monkeypatch):
    """Review 12, claim 3: a loop closed (no asyncio.run()) while a wait() looked whether an
    owed commit landed: the entry it held was lost, so the landed step's follow-up (its
    retention, with the memory tier its persist) never ran. It is owed again."""
    RULES.clear()
    HOLDS.clear()
    a = job(tmp_path, Clock(), "host-a", keep_last=1)
    a.register("c0", Handle(Comp(1)))
    loop = asyncio.new_event_loop()
    assert loop.run_until_complete(a.save(1)).committed
    lose_replies(monkeypatch, {2})
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        loop.run_until_complete(a.save(2))
    real, entered, go = follow_ups.committed_as, threading.Event(), threading.Event()

    def slow_look(store: object, manifest: object) -> bool:
        entered.set()
        assert go.wait(BOUND_S)
        return real(store, manifest)

    monkeypatch.setattr(follow_ups, "committed_as", slow_look)
    loop.create_task(a.wait())
    loop.run_until_complete(asyncio.to_thread(entered.wait, BOUND_S))
    loop.close()  # the wait() holding step 2's entry never ends
    go.set()
    monkeypatch.setattr(follow_ups, "committed_as", real)
    try:
        asyncio.run(asyncio.wait_for(a.wait(), BOUND_S))
        asyncio.run(asyncio.wait_for(a.aclose(), BOUND_S))
        assert forge_ckpt.committed_steps(str(tmp_path)) == [2], "step 2's retention never ran"
    finally:
        a.close()
        RULES.clear()
        HOLDS.clear()
