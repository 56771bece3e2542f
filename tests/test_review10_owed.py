"""Review 10: owed follow-ups (follow_ups.py) against held storage, no Ray.

A: a caller cancelled while it looked whether an owed commit landed took the entry with it
(its retention, or with the memory tier its pin and persist, never ran).
B: a wait() beside a rollback load(step=K) put an entry back after the load's look; the load
kept it owed, and the old branch's follow-up later undid the rollback (a deciding load now
waits for the entries other callers hold and decides them).
C: aclose() raised a background save's failure before running the owed follow-up.
G: a commit whose lease record write failed before it applied stayed in the lease's own
record; after a recovery load resumed the step before it, the next renewal recorded it and
it came back (a commit read as not landed is dropped from the record now).
F: wait() after the loop of a deferred save was closed under it raised a bare RuntimeError
(a future of another loop), not the cut-off CheckpointSaveError.
H (open): a new branch's retry of a landed save, after one failed look, is refused with
"already committed; save a different step number".
"""

from __future__ import annotations

import asyncio
import errno
import threading
from typing import Any

import pytest
from _held_storage import Clock, Comp, Handle, HeldFS, fail, held_rules, job  # noqa: F401
from _owed_faults import failing_looks, lose_replies, wait_cancelled_in_its_look

import forge_ckpt
from forge_ckpt import CheckpointConfig, CheckpointCoordinator, CheckpointSaveError
from forge_ckpt.coordination import follow_ups
from forge_ckpt.errors import CheckpointLockedError
from forge_ckpt.steps import lock
from forge_ckpt.steps.layout import LEASE
from forge_ckpt.storage import PreconditionFailedError

pytestmark = pytest.mark.usefixtures("held_rules")


async def train_again_save_and_load(a: Any, comp: Any, step: int) -> tuple[Any, Any]:
    """The job trains again from the step it resumed (version 20), saves `step`, then loads
    what is newest: (the save's result, the load's result; comp.version is what it loaded)."""
    comp.version = 20
    saved = await a.save(step)
    comp.version = -1
    again = await a.load()
    await a.aclose()
    return saved, again


async def test_a_wait_cancelled_in_its_look_drops_the_owed_entry(tmp_path, monkeypatch):
    a = job(tmp_path, Clock(), "host-a", keep_last=1)
    a.register("c0", Handle(Comp(1)))
    assert (await a.save(1)).committed
    lose_replies(monkeypatch, {2})  # step 2 lands, its reply is lost: owed
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        await a.save(2)
    assert [m.step for m, *_ in a._follow_ups.owed] == [2]
    await wait_cancelled_in_its_look(a, monkeypatch)
    owed_after = [m.step for m, *_ in a._follow_ups.owed]
    await a.wait()  # the next call: nothing is owed any more
    await a.aclose()
    on_disk = forge_ckpt.committed_steps(str(tmp_path))
    print(f"owed after the cancelled wait(): {owed_after}; committed {on_disk}")
    assert owed_after == [2], "the cancelled caller took the owed entry with it"
    assert on_disk == [2], f"step 2's follow-up (retention, keep_last=1) never ran: {on_disk}"


async def test_a_rollback_load_beside_a_wait_is_undone(tmp_path, monkeypatch):
    a = job(tmp_path, Clock(), "host-a", keep_last=10)
    comp = Comp(1)
    a.register("c0", Handle(comp))
    assert (await a.save(1)).committed
    lose_replies(monkeypatch, {2, 3})  # each lands (recorded), its reply is lost
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        await a.save(2)
    real = follow_ups.committed_as
    failing_looks(monkeypatch, 1)  # save(3)'s look at 2 fails: 2 stays owed
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        await a.save(3)
    assert [m.step for m, *_ in a._follow_ups.owed] == [2, 3]
    # the looks: load's at 2 (ok), wait()'s at 3 (fails), load's second at 3 (fails)
    entered = [threading.Event() for _ in range(2)]
    go = [threading.Event() for _ in range(2)]
    looks: list[tuple[int, str]] = []
    calls: list[int] = []

    def scripted(store: Any, manifest: Any) -> bool:
        i = len(calls)
        calls.append(manifest.step)
        if i < 2:
            entered[i].set()
            assert go[i].wait(60)
        if i in (1, 2):
            looks.append((manifest.step, "EIO"))
            raise OSError(errno.EIO, "read failed (test)")
        looks.append((manifest.step, "ok"))
        return real(store, manifest)

    monkeypatch.setattr(follow_ups, "committed_as", scripted)
    loading = asyncio.ensure_future(a.load(step=1))  # roll back to step 1
    assert await asyncio.to_thread(entered[0].wait, 60)  # the load looks at 2
    waiting = asyncio.ensure_future(a.wait())  # e.g. a shutdown path's wait()
    assert await asyncio.to_thread(entered[1].wait, 60)  # the wait() looks at 3
    # The load's look at 2 ends; then it either looks again at once (before the fix: its
    # `_quiesce`) or waits for the entry the wait() holds (the fix). Only then does the
    # wait()'s look at 3 fail: it puts entry 3 back.
    quiescing, blocked = asyncio.Event(), asyncio.Event()
    quiesce, follow = a._quiesce, a._follow_ups

    async def noted(*args: Any, **kw: Any) -> None:
        quiescing.set()
        await quiesce(*args, **kw)

    async def held_noted(held: list) -> None:
        blocked.set()
        await asyncio.wait(held)

    a._quiesce = noted  # type: ignore[method-assign]
    follow._await_held = held_noted  # type: ignore[method-assign]
    go[0].set()
    either = [asyncio.ensure_future(e.wait()) for e in (quiescing, blocked)]
    await asyncio.wait_for(asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED), 60)
    for t in either:
        t.cancel()
    go[1].set()
    loaded, _ = await asyncio.gather(loading, waiting)
    owed_after_load = [m.step for m, *_ in a._follow_ups.owed]
    assert loaded is not None and loaded.step == 1 and comp.version == 1
    saved, again = await train_again_save_and_load(a, comp, 2)  # the new branch
    print(
        f"\nlooks {looks}; owed after load(step=1): {owed_after_load}; new-branch "
        f"save(2) committed={saved.committed}; load() -> step {again and again.step}, "
        f"version {comp.version}"
    )
    assert owed_after_load == [], "the load chose a step with a follow-up still undecided"
    assert again is not None and (again.step, comp.version) == (2, 20), (
        "the rollback was undone: the new branch's save(2) saved nothing"
    )


async def test_aclose_after_a_failed_background_save_drops_its_follow_up(tmp_path, monkeypatch):
    a = job(tmp_path, Clock(), "host-a", async_mode="deferred", keep_last=1)
    a.register("c0", Handle(Comp(1)))
    await a.save(1)
    await a.wait()
    lose_replies(monkeypatch, {2})
    await a.save(2)  # returns at the snapshots; its commit lands, the reply is lost
    with pytest.raises(CheckpointSaveError, match="outcome is unknown") as raised:
        await a.aclose()
    on_disk = forge_ckpt.committed_steps(str(tmp_path))
    owed = [m.step for m, *_ in a._follow_ups.owed]
    print(f"\naclose() -> {str(raised.value)[:60]!r}...; owed left {owed}; committed {on_disk}")
    assert on_disk == [2], f"step 2's retention (keep_last=1) never ran: {on_disk}"


@pytest.mark.parametrize("failed_looks", [0, 1])
async def test_a_step_the_load_skipped_comes_back_with_the_next_renewal(
    tmp_path, monkeypatch, failed_looks
):
    """Its `COMMIT` written, step 2's record write fails before it applies: the lease's own
    record holds it (a later renewal writes it). The recovery load writes that record before
    it reads (review 11: dropping the step instead lost it when the record write landed
    late), also when its look then fails (review 11, claim 2): it resumes step 2, and a
    renewal after it changes nothing it chose from."""
    a = job(tmp_path, Clock(), "host-a", keep_last=10)
    comp = Comp(1)
    a.register("c0", Handle(comp))
    assert (await a.save(1)).committed
    comp.version = 2
    fail("replace", ".forge_ckpt.lease")  # the record write of step 2, before it applies
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        await a.save(2)
    failing_looks(monkeypatch, failed_looks)  # the recovery load's look: read errors
    comp.version = -1
    loaded = await a.load()  # a recovery: decides the owed commit of step 2
    assert loaded is not None
    first, listed = (loaded.step, comp.version), forge_ckpt.committed_steps(str(tmp_path))
    a._lease.renew()  # what the renewal thread does within lease_ttl_s / 3
    after_renewal = forge_ckpt.committed_steps(str(tmp_path))
    saved, again = await train_again_save_and_load(a, comp, first[0] + 1)
    print(
        f"\nrecovery load -> step {first[0]} version {first[1]}, listed {listed}; after the "
        f"renewal {after_renewal}; save({first[0] + 1}) committed={saved.committed}; load() "
        f"-> step {again and again.step} version {comp.version}"
    )
    assert first == (listed[-1], listed[-1]), "the load did not resume the newest step"
    assert after_renewal == listed, "a renewal changed the steps the load chose from"
    assert again is not None and (again.step, comp.version) == (first[0] + 1, 20)


async def test_a_record_write_that_lands_late_is_never_undone(tmp_path, monkeypatch):
    """Review 11, claims 1 and 1b: step 2's record write is sent, its caller told EIO, and it
    lands later. The load writes the lease's record (step 2 in it) before it reads, and the
    late write, conditional on the old tag, then lands nowhere: no reader ever sees step 2
    come and go (dropping it from the record, review 10's first fix for G, undid it)."""
    a = job(tmp_path, Clock(), "host-a", keep_last=10)
    comp = Comp(1)
    a.register("c0", Handle(comp))
    assert (await a.save(1)).committed
    comp.version = 2
    in_flight: list[tuple[Any, str, bytes, str]] = []
    arm = [False]
    real_replace, real_record = HeldFS.replace, lock.Lease.record

    def replace(self: Any, path: str, data: bytes, tag: str) -> Any:
        if arm[0] and path.endswith(LEASE):  # sent; the client gives up; it lands later
            arm[0] = False
            in_flight.append((self, path, bytes(data), tag))
            raise OSError(errno.EIO, "timed out (test): the request is still in flight")
        return real_replace(self, path, data, tag)

    def record(self: Any, step: int, generation: int) -> None:
        arm[0] = step == 2
        try:
            real_record(self, step, generation)
        finally:
            arm[0] = False

    monkeypatch.setattr(HeldFS, "replace", replace)
    monkeypatch.setattr(lock.Lease, "record", record)
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        await a.save(2)
    comp.version = -1
    loaded = await a.load()
    seen = [forge_ckpt.committed_steps(str(tmp_path))]
    store, path, data, tag = in_flight.pop()
    with pytest.raises(PreconditionFailedError):
        real_replace(store, path, data, tag)  # the late write: its tag is gone
    seen.append(forge_ckpt.committed_steps(str(tmp_path)))
    a._lease.renew()
    seen.append(forge_ckpt.committed_steps(str(tmp_path)))
    await a.aclose()
    print(f"\nload -> step {loaded and loaded.step} (version {comp.version}); a reader: {seen}")
    assert loaded is not None and (loaded.step, comp.version) == (2, 2)
    assert seen == [[1, 2]] * 3


def test_a_loop_closed_with_a_deferred_save_in_flight(tmp_path):
    coord = CheckpointCoordinator(CheckpointConfig(folder=str(tmp_path), async_mode="deferred"))
    coord.register("c0", Handle(Comp(1)))
    loop = asyncio.new_event_loop()
    loop.run_until_complete(coord.save(1))  # returns at the snapshots
    loop.close()  # the background part never ran to its end
    outcomes = []
    for name, call in (("wait", coord.wait), ("save", lambda: coord.save(2)),
                       ("load", coord.load)):  # fmt: skip
        try:
            outcomes.append((name, repr(asyncio.run(call()))[:80]))
        except BaseException as e:  # noqa: BLE001
            outcomes.append((name, f"{type(e).__name__}: {e}"[:100]))
    try:
        coord.close()
        outcomes.append(("close", "ok"))
    except BaseException as e:  # noqa: BLE001
        outcomes.append(("close", f"{type(e).__name__}: {e}"[:100]))
    try:
        other = CheckpointCoordinator(CheckpointConfig(folder=str(tmp_path)))
        other.close()
        outcomes.append(("another coordinator opens", "ok"))
    except CheckpointLockedError as e:
        outcomes.append(("another coordinator opens", f"CheckpointLockedError: {e}"[:100]))
    finally:
        coord._lease.release()  # the test's own cleanup
    print("\n" + "\n".join(f"{n}: {o}" for n, o in outcomes))
    assert outcomes[0][1].startswith("CheckpointSaveError"), "wait() raised a bare error"


async def test_a_branch_retry_after_a_failed_look(tmp_path, monkeypatch):
    """Review 10, H: after a rollback, save(2)'s reply was lost (it landed); its retry could
    not read whether it had, and was refused with "already committed; save a different step
    number", which would skip a step of the new branch. The retry now says it cannot tell
    yet and to retry; the next retry finds step 2 committed, and a load resumes it."""
    a = job(tmp_path, Clock(), "host-a", keep_last=10)
    comp = Comp(1)
    a.register("c0", Handle(comp))
    for s in (1, 2, 3):
        assert (await a.save(s)).committed
    assert (await a.load(step=1)).step == 1
    comp.version = 20
    lose_replies(monkeypatch, {2})
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        await a.save(2)
    failing_looks(monkeypatch, 1)
    with pytest.raises(CheckpointSaveError, match=r"cannot tell yet.*retry save\(2\)") as e:
        await a.save(2)
    assert "different step number" not in str(e.value)
    retry = await a.save(2)
    comp.version = -1
    got = await a.load()
    await a.aclose()
    print(f"\nfirst retry: {str(e.value)[:150]!r}; second: {retry}; load() -> {got and got.step}")
    assert retry.committed and got is not None and got.step == 2 and comp.version == 20
