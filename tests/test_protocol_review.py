"""The protocol breaks of the second hostile review of issue 22 (branch review22b, repro/),
each a test of the invariant it broke (docs/protocol.md: I1 a step reported committed stays
until retention or a committed rollback removes it; I2 no abandoned step is listed or loads;
I3 a writer that lost the lease cannot change the folder; I7 a live job can always save).

Every race is forced with events on held storage calls and a virtual wall clock (the lease's
expiry), never with sleeps; the real coordinator, lease, commit and storage code run, on a
local folder or on the simulation's in-memory S3 server. Fixed by 2eabad3; each test fails
on the code before it (4b17fac)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import threading
from collections.abc import Callable
from typing import Any

import pytest
from _held_storage import (
    WAIT_S,
    Clock,
    Comp,
    Handle,
    Hold,
    fail,
    held_rules,  # noqa: F401 (a fixture)
    hold,
    job,
    without_attempt,
)

from forge_ckpt import CheckpointConfig, CheckpointCoordinator
from forge_ckpt.coordination.runtime import Runtime
from forge_ckpt.errors import CheckpointError, CheckpointLockedError
from forge_ckpt.steps import layout
from forge_ckpt.storage import SCHEMES, StorageSpec
from forge_ckpt.storage.local import LocalStorage
from forge_ckpt.storage.s3 import S3Storage

pytestmark = pytest.mark.usefixtures("held_rules")

ZOMBIE = threading.local()  # set in the thread of the stale job's actor write


class Stalled(Comp):
    """The stale job's actor: only the write its forge_begin_save starts is marked."""

    def forge_begin_save(self, *args: Any, **kw: Any) -> Any:
        ZOMBIE.on = True
        try:
            return super().forge_begin_save(*args, **kw)
        finally:
            ZOMBIE.on = False


def _in_zombie() -> bool:
    return getattr(ZOMBIE, "on", False)


async def _stale_write_lands_after_takeover(
    a: CheckpointCoordinator,
    held: Hold,
    take_over: Callable[[], CheckpointCoordinator],
    clock: Clock,
) -> CheckpointCoordinator:
    """A saves step 1 with its actor's write held; A's lease expires; B takes over and
    commits step 1; then A's write goes on. Returns B."""
    a.register("c0", Handle(Stalled(111)))
    a_save = asyncio.ensure_future(a.save(1))
    await held.reached()
    clock.t += 60.0  # A's lease (ttl 30 s) expires while its actor's write is stalled
    b = take_over()
    b.register("c0", Handle(b_comp := Comp(222)))
    assert (await b.save(1)).committed
    held.go.set()
    with pytest.raises(CheckpointError):
        await a_save
    b_comp.version = 0
    loaded = await b.load()
    assert loaded is not None and loaded.step == 1 and b_comp.version == 222
    return b


async def test_a_stale_actor_write_never_changes_the_successors_committed_file(tmp_path):
    """Break (review22b zombie_actor_write): a stalled actor write of a job that lost the
    lease opened the successor's committed step-1 file with O_TRUNC and wrote over it; the
    step no longer loaded. Invariant (I3, I1): the successor's committed step loads, with
    its own state, after the stale write lands."""
    clock = Clock()
    a = job(tmp_path, clock, "host-a", lease_ttl_s=30.0, keep_last=None)
    held = hold("writer", "step-1/actors/c0.0.msgpack", only=_in_zombie)

    def take_over() -> CheckpointCoordinator:
        return job(tmp_path, clock, "host-b", lease_ttl_s=30.0, keep_last=None)

    b = await _stale_write_lands_after_takeover(a, held, take_over, clock)
    assert layout.read_committed(str(tmp_path), 1).step == 1
    b.close()


S3: dict[str, Any] = {}  # the in-memory S3 client of the running test; its held PUT


class HeldS3(S3Storage):
    """S3Storage on the simulation's in-memory S3 server of the running test."""

    def __init__(self, spec: StorageSpec) -> None:
        url = "s3://" + spec.url.split("://", 1)[1]
        super().__init__(StorageSpec(url, {**spec.options, "max_concurrency": 1}))
        self.client = S3["client"]
        self.spec = spec

    def sub(self, prefix: str) -> HeldS3:
        return HeldS3(self.spec.child(prefix))

    def close(self) -> None:
        return None


SCHEMES["helds3://"] = HeldS3


def _s3_gate(op: str, key: str, mutates: bool) -> str:
    """Holds the stale job's actor PUT of step 1 (the first one only)."""
    held: Hold = S3["held"]
    if (
        op == "put_object"
        and without_attempt(key).endswith("step-1/actors/c0.0.msgpack")
        and _in_zombie()
    ):
        if not held.entered.is_set():
            held.entered.set()
            assert held.go.wait(WAIT_S), "the held PUT was never let go"
    return "ok"


async def test_a_stale_actor_put_never_replaces_the_successors_committed_object():
    """Break (review22b zombie_actor_write_s3): on S3, a stale job's actor PUT delayed past
    its lease replaced the same-named object of the successor's committed step. Invariant
    (I3, I1): the successor's committed step loads, with its own state, after it lands."""
    pytest.importorskip("boto3", reason="S3Storage needs boto3 (pip install -e '.[test]')")
    from forge_ckpt.sim.s3server import Bucket, Client

    S3["held"] = held = Hold()
    S3["client"] = Client(Bucket(), _s3_gate)
    clock = Clock()

    def s3_job(host: str) -> CheckpointCoordinator:
        cfg = CheckpointConfig(folder="helds3://bkt/runs/exp1", lease_ttl_s=30.0, keep_last=None)
        identity = {"host": host, "pid": 1, "pid_start": "1"}
        return CheckpointCoordinator(
            cfg, runtime=Runtime(wall=clock, lease_thread=False, identity=identity)
        )

    try:
        b = await _stale_write_lands_after_takeover(
            s3_job("host-a"), held, lambda: s3_job("host-b"), clock
        )
        b.close()
    finally:
        held.go.set()


async def _save_steps(coord: CheckpointCoordinator, comp: Comp, steps: range, base: int) -> None:
    """Save each step with version base + step (base tells the branches apart)."""
    for step in steps:
        comp.version = base + step
        assert (await coord.save(step)).committed


async def test_a_stale_rollback_never_sets_aside_the_successors_step(tmp_path):
    """Break (review22b stale_set_aside): a job that lost its lease, saving after its own
    rollback, moved the successor's newest committed step to replaced/ (the set-aside was
    unfenced); the successor's load() resumed an older step. Invariant (I3): the stale
    save is refused and changes nothing; the successor keeps and loads its step 4."""
    clock = Clock()
    a = job(tmp_path, clock, "host-a", lease_ttl_s=30.0, keep_last=None)
    a.register("c0", Handle(ca := Comp()))
    await _save_steps(a, ca, range(1, 4), 100)
    await a.load(step=1)
    clock.t += 60.0  # A stalls past its lease
    b = job(tmp_path, clock, "host-b", lease_ttl_s=30.0, keep_last=None)
    b.register("c0", Handle(cb := Comp()))
    await b.load()
    await _save_steps(b, cb, range(4, 5), 200)
    with pytest.raises(CheckpointError):
        await a.save(4)
    assert b.steps() == [1, 2, 3, 4]
    cb.version = 0
    loaded = await b.load()
    assert loaded is not None and loaded.step == 4 and cb.version == 204
    b.close()


async def test_a_stale_job_is_not_told_its_successors_step_is_committed(tmp_path):
    """Sim seed 10363: a job taken over saves a step number its successor has committed
    meanwhile; `save` found it committed and returned "committed" without writing (the
    idempotent path), so the stale job believed its own state was saved. Invariant (I3):
    the stale save is refused (lost lease) and the successor's step stays its own."""
    clock = Clock()
    a = job(tmp_path, clock, "host-a", lease_ttl_s=30.0, keep_last=None)
    a.register("c0", Handle(ca := Comp()))
    await _save_steps(a, ca, range(1, 3), 100)
    await a.load()  # A forgets what it saw: its next save lists the folder
    clock.t += 60.0  # A stalls past its lease
    b = job(tmp_path, clock, "host-b", lease_ttl_s=30.0, keep_last=None)
    b.register("c0", Handle(cb := Comp()))
    await b.load()
    await _save_steps(b, cb, range(3, 4), 200)
    with pytest.raises(CheckpointLockedError, match="lost the lease"):
        await a.save(3)
    cb.version = 0
    loaded = await b.load()
    assert loaded is not None and loaded.step == 3 and cb.version == 203
    b.close()


class Failing(Comp):
    def forge_begin_save(self, *args: Any, **kw: Any) -> Any:
        raise RuntimeError("actor failed its snapshot (test)")


async def test_a_stale_abort_delete_never_removes_the_successors_step(tmp_path):
    """Break (review22b late_abort_delete): check() let a third of the TTL pass without a
    renewal, so an abort's delete that took less than the call bound still landed after
    the lease expired, and removed the step the successor had committed meanwhile.
    Invariant (I3, I1): the abort renews the lease before it deletes (at t0+19 s, ttl 60 s:
    held until t0+79 s), so the successor is refused while the delete is in flight; once it
    has landed and the lease expired, the successor takes over and keeps what it commits."""
    clock = Clock()
    t0 = clock.t
    a = job(tmp_path, clock, "host-a", lease_ttl_s=60.0, keep_last=None)
    a.register("c0", Handle(Failing(1)))
    clock.t = t0 + 19.0  # the last renewal is 19 s old: check() alone would not renew
    held = hold("delete_prefix", "step-1")
    a_save = asyncio.ensure_future(a.save(1))
    await held.reached()
    clock.t = t0 + 61.0  # the delete takes 42 s, within S3's default call bound (58 s)
    with pytest.raises(CheckpointLockedError):
        job(tmp_path, clock, "host-b", lease_ttl_s=60.0, keep_last=None)
    held.go.set()
    with pytest.raises(CheckpointError):
        await a_save
    clock.t = t0 + 80.0  # past the renewal the abort made at t0+19 s
    b = job(tmp_path, clock, "host-b", lease_ttl_s=60.0, keep_last=None)
    b.register("c0", Handle(comp := Comp()))
    await _save_steps(b, comp, range(1, 3), 200)
    comp.version = 0
    assert (await b.load(step=1)).step == 1 and comp.version == 201
    assert b.steps() == [1, 2] == layout.committed_steps(str(tmp_path))
    b.close()


async def _idle(coord: CheckpointCoordinator) -> None:
    """A condition, bounded: no storage call of the coordinator runs any more."""
    for _ in range(int(WAIT_S * 1000)):
        if coord._calls.busy == 0:
            return
        await asyncio.to_thread(threading.Event().wait, 0.001)
    raise AssertionError("the commit thread never ended")


async def test_a_cancelled_rollback_save_that_committed_is_not_abandoned(tmp_path):
    """Break (review22b rollback_unknown_commit): a rollback's first save, cancelled while
    its COMMIT was written, committed but left the rollback pending; the next save started
    the branch again and removed that step as abandoned. Invariant (I1): step 4, committed
    on the live branch, stays and loads (keep_last=None keeps all)."""
    a = job(tmp_path, Clock(), "host-a", keep_last=None)
    a.register("c0", Handle(comp := Comp()))
    await _save_steps(a, comp, range(1, 6), 100)
    await a.load(step=3)
    comp.version = 204
    held = hold("create", "step-4/COMMIT")
    task = asyncio.ensure_future(a.save(4))
    await held.reached()
    task.cancel()  # a caller's asyncio.wait_for(coord.save(4), timeout) timing out
    held.go.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _idle(a)
    assert 5 not in a.steps()  # the rollback's commit abandoned old step 5
    await _save_steps(a, comp, range(5, 6), 200)
    assert a.steps() == [1, 2, 3, 4, 5]
    comp.version = 0
    assert (await a.load(step=4)).step == 4 and comp.version == 204
    a.close()


async def test_a_set_aside_step_of_an_abandoned_branch_never_comes_back(tmp_path):
    """Break (review22b aside_resurrects): the abandoned step 3 set aside in replaced/
    could not be dropped; once retention removed the new step 3, the next start put the
    abandoned one back, live and loadable. Invariant (I2): no later job lists or loads it."""
    clock = Clock()
    a = job(tmp_path, clock, "host-a", keep_last=3)
    a.register("c0", Handle(comp := Comp()))
    await _save_steps(a, comp, range(1, 4), 100)
    await a.load(step=2)
    fail("delete_prefix", "replaced/step-3")
    await _save_steps(a, comp, range(3, 7), 200)
    a.close()
    b = job(tmp_path, clock, "host-a", keep_last=3)
    b.register("c0", Handle(comp_b := Comp()))
    assert b.steps() == [4, 5, 6]
    with pytest.raises(CheckpointError):
        await b.load(step=3)
    assert comp_b.version == 0
    b.close()


async def test_a_failed_retire_neither_blocks_the_new_branch_nor_revives_the_old(tmp_path):
    """Break (review22b failed_retire): after a rollback whose removal of the abandoned step
    5 failed, (a) save(5) on the new branch was refused as already committed, and (b) once
    retention removed the new step 4 that recorded the abandonment, the old step 5 loaded
    again. Invariants (I7-like, I2): the new branch saves every step number; no abandoned
    step loads."""
    a = job(tmp_path, Clock(), "host-a", keep_last=None)
    a.register("c0", Handle(comp := Comp()))
    await _save_steps(a, comp, range(1, 6), 100)
    await a.load(step=3)
    fail("delete", "step-5/COMMIT")
    await _save_steps(a, comp, range(4, 6), 200)  # (a): save(5) is not refused
    a.config.keep_last = 1  # retention from now on keeps only the newest step
    await _save_steps(a, comp, range(6, 7), 200)
    assert a.steps() == [6]
    comp.version = 0
    loaded = await a.load()
    assert loaded is not None and loaded.step == 6 and comp.version == 206
    with pytest.raises(CheckpointError):
        await a.load(step=5)
    assert comp.version == 206
    a.close()


class Frozen:
    """A wall clock that does not advance (coarse, frozen or stepped back)."""

    def __call__(self) -> float:
        return 1_000_000.0


async def test_a_new_step_never_supersedes_itself(tmp_path):
    """Break (review22b self_supersede): with a wall clock that did not advance, the new
    branch's step 4 had the same `created` as the abandoned step 4 and was removed as
    superseded right after it was reported committed. Invariant (I1): it stays and loads."""
    a = job(tmp_path, Frozen(), "host-a", keep_last=None)
    a.register("c0", Handle(comp := Comp()))
    await _save_steps(a, comp, range(1, 6), 100)
    await a.load(step=3)
    await _save_steps(a, comp, range(4, 5), 200)
    assert a.steps() == [1, 2, 3, 4]
    comp.version = 0
    loaded = await a.load()
    assert loaded is not None and loaded.step == 4 and comp.version == 204
    a.close()


def _applied_then_lost(times: int) -> Any:
    """LocalStorage.replace whose next `times` lease writes apply, then fail as a request
    whose reply was lost (outcome unknown)."""
    left = [times]

    def replace(self: LocalStorage, path: str, data: bytes, tag: Any) -> Any:
        new = LocalStorage.replace(self, path, data, tag)
        if path.endswith(layout.LEASE) and left[0] > 0:
            left[0] -= 1
            raise OSError(errno.ETIMEDOUT, f"{path}: timed out (test; it was applied)")
        return new

    return replace


async def test_two_lease_writes_of_unknown_outcome_are_still_ours(tmp_path, monkeypatch):
    """Break (review22b lease_double_unknown): two renewals in a row whose outcome was
    unknown (applied, reply lost) made the job conclude another job had taken its lease
    (itself) and refuse every save. Invariant (I7): nobody else touched the lease, so the
    job still saves."""
    clock = Clock()
    a = job(tmp_path, clock, "host-a", lease_ttl_s=60.0, keep_last=None)
    a.register("c0", Handle(comp := Comp()))
    await _save_steps(a, comp, range(1, 2), 100)
    monkeypatch.setattr(type(a.store), "replace", _applied_then_lost(2))
    for _ in range(2):
        clock.t += 20.0
        with contextlib.suppress(OSError):
            a._lease.renew()  # what the renewal thread does every ttl/3
    clock.t += 20.0
    await _save_steps(a, comp, range(2, 3), 100)
    comp.version = 0
    assert (await a.load()).step == 2 and comp.version == 102
    a.close()


async def _cancel_mid_set_aside(coord: CheckpointCoordinator, step: int) -> None:
    """save(step) of a new branch, cancelled by its caller's deadline while it sets the
    abandoned step of that number aside; the move goes on in its thread."""
    move = hold("move_prefix", f"step-{step}")
    saving = asyncio.ensure_future(coord.save(step))
    await move.reached()
    saving.cancel()
    move.go.set()
    with pytest.raises(asyncio.CancelledError):
        await saving


async def test_a_cancelled_set_aside_is_put_back_by_the_next_load(tmp_path):
    """Break (review3 claim 10, sim seed 20990): after load(step=1), save(2) was cancelled
    while it set step 2 of the abandoned branch aside; nothing put it back, and committed
    step 2 could not be loaded for the rest of the session (I2). The next load waits for the
    cancelled call's thread and puts the step back first."""
    a = job(tmp_path, Clock(), "host-a", keep_last=None)
    a.register("c0", Handle(comp := Comp()))
    await _save_steps(a, comp, (1, 2, 3), 100)
    assert (await a.load(step=1)).step == 1
    await _cancel_mid_set_aside(a, 2)
    assert (await a.load(step=2)).step == 2 and comp.version == 102
    assert a.steps() == [1, 2, 3]
    a.close()


async def test_a_step_set_aside_by_a_cancelled_save_is_abandoned_by_the_next_branch(tmp_path):
    """Break (review3 claim 5, sim seed 40389 with FORGE_SIM_CANCEL_SAVES=0.4): load(step=2),
    save(3) cancelled while step 3 was set aside; load(step=1) did not see step 3, so the new
    branch from 1 did not abandon it, and the next start put it back as the newest step (I2)."""
    clock = Clock()
    a = job(tmp_path, clock, "host-a", keep_last=None)
    a.register("c0", Handle(comp := Comp()))
    await _save_steps(a, comp, (1, 2, 3), 100)
    assert (await a.load(step=2)).step == 2
    await _cancel_mid_set_aside(a, 3)
    assert (await a.load(step=1)).step == 1  # roll back further: 2 and 3 are abandoned
    comp.version = 202
    assert (await a.save(2)).committed
    a.close()
    b = job(tmp_path, clock, "host-a", keep_last=None)  # the next start
    b.register("c0", Handle(again := Comp()))
    assert (await b.load()).step == 2 and again.version == 202 and b.steps() == [1, 2]
    b.close()


class HeldApply(Comp):
    """Applies only once `go` is set (a load_state_dict behind other work of its actor)."""

    def __init__(self, version: int, go: threading.Event) -> None:
        super().__init__(version)
        self.go = go

    def load_state_dict(self, state: dict) -> None:
        assert self.go.wait(WAIT_S)
        super().load_state_dict(state)


class FailApply(Comp):
    def load_state_dict(self, state: dict) -> None:
        raise RuntimeError("load_state_dict failed (test)")


async def test_a_component_with_a_late_replica_is_reported_unknown_not_unapplied(tmp_path):
    """Break (review3 claim 12, I4): one replica timed out (it applies later) and one raised;
    the error called the component "not applied", and the late replica then applied."""
    a = job(tmp_path, Clock(), "host-a", keep_last=None, load_timeout_s=1.0)
    a.register("c", [Handle(Comp(11)), Handle(Comp(12))])
    assert (await a.save(1)).committed
    go = threading.Event()
    slow = HeldApply(0, go)  # never answers before the error: it waits for `go`
    a.register("c", [Handle(slow), Handle(FailApply(0))], replace=True)
    try:
        with pytest.raises(CheckpointError) as info:
            await a.load()
        assert info.value.unknown == ["c"] and info.value.not_applied == []  # type: ignore[attr-defined]
        assert "unknown: c" in str(info.value)
    finally:
        go.set()
        a.close()
