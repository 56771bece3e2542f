"""Review 3's breaks of the fence (docs/protocol.md "One writer per folder"), each made
deterministic with held storage calls (tests/_held_storage.py) or the simulation's in-memory
S3 server: every held call stands for a request in flight within S3's call bound (58 s)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
from typing import Any

import pytest
from _held_storage import (
    WAIT_S,
    Clock,
    Comp,
    Handle,
    Hold,
    held_config,
    held_rules,  # noqa: F401 (a fixture)
    hold,
    job,
)

from forge_ckpt import CheckpointConfig, CheckpointCoordinator
from forge_ckpt.coordination.runtime import Runtime
from forge_ckpt.errors import CheckpointError, CheckpointLeaseCorruptError, CheckpointLockedError
from forge_ckpt.steps import layout, lease_record
from forge_ckpt.storage import SCHEMES, StorageSpec
from forge_ckpt.storage.s3 import S3Storage

pytestmark = pytest.mark.usefixtures("held_rules")

S3: dict[str, Any] = {}  # the running S3 test's in-memory client, clock, holds and log
_BUCKETS = itertools.count()


class FenceS3(S3Storage):
    """S3Storage on the simulation's in-memory S3 server of the running test."""

    def __init__(self, spec: StorageSpec) -> None:
        url = "s3://" + spec.url.split("://", 1)[1]
        super().__init__(StorageSpec(url, {**spec.options, "max_concurrency": 1}))
        self.client = S3["client"]
        self.spec = spec

    def sub(self, prefix: str) -> FenceS3:
        return FenceS3(self.spec.child(prefix))

    def close(self) -> None:
        return None


SCHEMES["fences3://"] = FenceS3


def _s3(gate: Any) -> Clock:
    """A fresh in-memory bucket whose every request passes `gate` first; the test's clock."""
    pytest.importorskip("boto3", reason="S3Storage needs boto3 (pip install -e '.[test]')")
    from forge_ckpt.sim.s3server import Bucket, Client

    S3.clear()
    S3["held"], S3["held2"], S3["log"] = Hold(), Hold(), []
    S3["bucket"] = f"bkt{next(_BUCKETS)}"  # open_storage caches a storage per folder URL
    S3["client"] = Client(Bucket(), gate)
    S3["clock"] = clock = Clock()
    return clock


def s3_job(clock: Clock, host: str, **kw: Any) -> CheckpointCoordinator:
    cfg = CheckpointConfig(
        folder=f"fences3://{S3['bucket']}/runs/exp1", lease_ttl_s=30.0, keep_last=None, **kw
    )
    identity = {"host": host, "pid": 1, "pid_start": "1"}
    return CheckpointCoordinator(
        cfg, runtime=Runtime(wall=clock, lease_thread=False, identity=identity)
    )


class FailingSnapshot(Comp):
    def forge_begin_save(self, *args: Any, **kw: Any) -> Any:
        raise RuntimeError("actor failed its snapshot (test)")


class FailingWrite(Comp):
    """Writes its file, then reports a failure (a write error found at the end)."""

    def forge_save_status(self) -> Any:
        recs = super().forge_save_status()
        if recs is None:
            return None
        raise RuntimeError("actor failed its write (test)")


class BigComp(Comp):
    def state_dict(self) -> dict:
        return {"version": self.version, "pad": bytes(2_500_000)}  # 3 parts of 1 MiB


def _set_aside_gate(op: str, key: str, mutates: bool) -> str:
    """The set-aside's copies into replaced/step-2/ are slow: the first takes 20 s (virtual),
    the second is held while the successor acts (each well within S3's 58 s call bound)."""
    held: Hold = S3["held"]
    if op == "copy_object" and "/replaced/step-2/" in key and not held.entered.is_set():
        S3["copies"] = S3.get("copies", 0) + 1
        if S3["copies"] == 1:
            S3["clock"].t += 20.0
        else:
            held.entered.set()
            assert held.go.wait(WAIT_S), "the held copy was never let go"
    S3["log"].append((op, key))
    return "ok"


async def test_a_stale_s3_set_aside_never_deletes_the_successors_marker():
    """Review 3, claim 3: on S3 a set-aside (rollback) is copies, then deletes. The copies
    took longer than the lease; a successor took over and committed step 4; the stale job's
    delete of step-2/COMMIT (no fence after the copies) removed the successor's committed
    step 2. Invariant (I1, I3): every delete of a move is fenced; step 2 stays."""
    clock = _s3(_set_aside_gate)
    held: Hold = S3["held"]
    a = s3_job(clock, "host-a")
    a.register("c0", Handle(comp := Comp()))
    for step in (1, 2, 3):
        comp.version = 100 + step
        assert (await a.save(step)).committed
    assert (await a.load(step=1)).step == 1  # rollback: 2 and 3 abandoned at the next save
    a_save = asyncio.ensure_future(a.save(2))  # sets step 2 aside first (copies, then deletes)
    b = None
    try:
        await held.reached()
        clock.t += 20.0  # the second copy takes 20 s too: A's lease (ttl 30 s) expired
        clock.t += 5.0  # ... past the clock-skew allowance too
        b = s3_job(clock, "host-b")
        b.register("c0", Handle(bcomp := Comp()))
        got = await b.load()
        assert got is not None and got.step == 3
        bcomp.version = 204
        assert (await b.save(4)).committed
        held.go.set()  # A's copies go on; then A would delete step-2/COMMIT
        with pytest.raises(CheckpointError):
            await a_save
        assert b.steps() == [1, 2, 3, 4]
        assert not [k for op, k in S3["log"] if op.startswith("delete") and "/exp1/step-2/" in k]
    finally:
        held.go.set()
        if b is not None:
            b.close()


def _abort_uploads_gate(op: str, key: str, mutates: bool) -> str:
    """A's upload listing of step-1 (its abort's, after the fenced deletes) is slow; B's
    multipart completion of step-1's file waits until A's listing was answered."""
    S3["log"].append((op, key))
    first: Hold = S3["held"]
    second: Hold = S3["held2"]
    if op == "list_multipart_uploads" and key.endswith("/step-1/") and S3.get("armed"):
        if not first.entered.is_set():
            first.entered.set()
            assert first.go.wait(WAIT_S)
    if op == "complete_multipart_upload" and "/step-1/" in key and first.entered.is_set():
        if not second.entered.is_set():
            second.entered.set()
            assert second.go.wait(WAIT_S)
    return "ok"


async def test_a_stale_abort_never_aborts_the_successors_upload():
    """Review 3, claim 11: delete_prefix fenced each delete batch, not the abort of the
    unfinished uploads that follows: a stale job's upload listing answered after the take-over
    named the successor's in-flight multipart upload of the same step and aborted it, and the
    successor's save failed ("does not exist"). Invariant (I3): the stale abort is refused
    before it aborts anything; the successor's save commits."""
    clock = _s3(_abort_uploads_gate)
    held, held2 = S3["held"], S3["held2"]
    big = {"storage_options": {"part_size_mb": 1}}
    a = s3_job(clock, "host-a", **big)
    a.register("c0", Handle(FailingWrite(1)))
    clock.t += 5.0
    S3["armed"] = True
    a_save = asyncio.ensure_future(a.save(1))
    b = None
    try:
        await held.reached()  # A's listing of step-1's uploads is in flight
        clock.t += 40.0  # it is answered late (within the 58 s bound): A's lease expired
        b = s3_job(clock, "host-b", **big)
        b.register("c0", Handle(bcomp := BigComp(201)))
        b_save = asyncio.ensure_future(b.save(1))
        await held2.reached()  # B's file is uploaded, its completion about to go
        held.go.set()  # A's listing is answered: it names B's upload
        with pytest.raises(CheckpointError):
            await a_save
        held2.go.set()
        assert not [k for op, k in S3["log"] if op == "abort_multipart_upload"]
        assert (await b_save).committed
        bcomp.version = 0
        got = await b.load(step=1)
        assert got is not None and bcomp.version == 201
    finally:
        held.go.set()
        held2.go.set()
        if b is not None:
            b.close()


async def test_a_fresh_renewal_counts_from_its_send(tmp_path):
    """Review 3, claim 4: check(fresh=True) took the renewal's time at its reply, while the
    expiry it wrote was computed at its send. A renewal that took 50 s, then a delete that
    took 11 s (each within the 58 s bound), landed after the expiry and removed the
    successor's committed step 1. Invariant (I1, I3): the renewal counts from its send, so
    the delete is fenced again (a second renewal: it learns it lost the lease) and removes
    nothing."""
    clock = Clock()
    t0 = clock.t
    a = job(tmp_path, clock, "host-a", lease_ttl_s=60.0, keep_last=None)
    a.register("c0", Handle(FailingSnapshot(1)))
    clock.t = t0 + 19.0  # last renewal 19 s old: the abort's fresh check renews
    renew = hold("replace", ".forge_ckpt.lease")
    a_save = asyncio.ensure_future(a.save(1))
    await renew.reached()  # the abort's fresh renewal is in flight, expiry t0+79 in it
    clock.t = t0 + 69.0  # its reply comes 50 s later
    stale = hold("replace", ".forge_ckpt.lease")  # A's next renewal, if any, lands late
    renew.go.set()
    await stale.reached()  # A renews again before its delete: 50 s passed since the send
    clock.t = t0 + 90.0  # ... and lands after B took over
    b = job(tmp_path, clock, "host-b", lease_ttl_s=60.0, keep_last=None)
    b.register("c0", Handle(comp := Comp()))
    for step in (1, 2):
        comp.version = 200 + step
        assert (await b.save(step)).committed
    stale.go.set()
    with pytest.raises(CheckpointError):
        await a_save
    try:
        assert layout.committed_steps(str(tmp_path)) == [1, 2]
    finally:
        b.close()


class Skewed:
    """Another machine's clock: `offset` seconds ahead of `base`."""

    def __init__(self, base: Clock, offset: float) -> None:
        self.base, self.offset = base, offset

    def __call__(self) -> float:
        return self.base() + self.offset


async def test_clock_skew_within_the_allowance_keeps_the_delete_fence(tmp_path):
    """Review 3, claim 6: the fence's margin is TTL - call bound - FRESH_S = 60 - 58 - 1 = 1 s
    across two machines' clocks; with the successor's clock 2.5 s ahead, it took over while
    the stale abort's delete (sent at once after a fresh renewal, landing 57.9 s later) was
    still in flight, and lost its step 1. Invariant (I1): another machine's lease is live
    until its expiry plus max_clock_skew_s (5 s): the successor takes over only after every
    request the stale job sent under its last renewal has landed."""
    clock = Clock()
    skewed: dict[str, Any] = {"lease_ttl_s": 60.0, "keep_last": None, "max_clock_skew_s": 5.0}
    a = job(tmp_path, clock, "host-a", **skewed)
    a.register("c0", Handle(FailingSnapshot(1)))
    clock.t += 5.0  # the abort's fresh check renews at A's t
    delete = hold("delete_prefix", "step-1")
    a_save = asyncio.ensure_future(a.save(1))
    await delete.reached()
    clock.t += 57.9  # A's delete is in flight 57.9 s after it was sent (bound: 58 s)
    with pytest.raises(CheckpointLockedError):  # B's clock: t + 60.4, past A's expiry
        job(tmp_path, Skewed(clock, 2.5), "host-b", **skewed)
    delete.go.set()  # A's delete lands on its own step
    with pytest.raises(CheckpointError):
        await a_save
    clock.t += 10.0  # B's clock is now past A's expiry plus the allowance
    b = job(tmp_path, Skewed(clock, 2.5), "host-b", **skewed)
    b.register("c0", Handle(Comp(201)))
    try:
        assert (await b.save(1)).committed
        assert layout.committed_steps(str(tmp_path)) == [1]
    finally:
        b.close()


def test_the_clock_skew_allowance_is_checked(tmp_path):
    """A negative allowance would shorten another machine's lease: refused, named."""
    with pytest.raises(ValueError, match="max_clock_skew_s"):
        CheckpointConfig(folder=str(tmp_path), max_clock_skew_s=-1.0)


async def _close_behind_a_held_renewal(coord: CheckpointCoordinator) -> bool:
    """Whether close() returned while the lease's renewal is held in its storage call (the
    renewal is let go after)."""
    renew = hold("replace", ".forge_ckpt.lease")
    await renew.reached()
    done = threading.Event()
    closer = threading.Thread(target=lambda: (coord.close(), done.set()), daemon=True)
    closer.start()
    returned = await asyncio.to_thread(done.wait, WAIT_S)
    renew.go.set()
    return returned


async def test_close_never_blocks_behind_a_renewal_in_flight(tmp_path):
    """Review 3, claim 13: close() joined the renewal thread (5 s), then waited for the lease
    mutex, held by a renewal whose storage call hung (a slow PUT, a hung NFS mount). Now
    close() returns at once; the release is written once that renewal ends, and the
    renewal thread writes nothing after it."""
    coord = CheckpointCoordinator(held_config(tmp_path, lease_ttl_s=0.3))  # renews every 0.1 s
    assert await _close_behind_a_held_renewal(coord), "close() blocked behind the renewal"
    lease_file = tmp_path / ".forge_ckpt.lease"
    for _ in range(int(WAIT_S * 100)):  # the release lands once the renewal ends (bounded)
        if lease_record.parse_lease(lease_file.read_bytes(), "lease").get("released"):
            break
        await asyncio.sleep(0.01)
    assert lease_record.parse_lease(lease_file.read_bytes(), "lease")["released"]
    other = CheckpointCoordinator(held_config(tmp_path, lease_ttl_s=0.3))  # free at once
    other.close()


def _damage(path: Any) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one damaged bit: still valid JSON most of the time
    path.write_bytes(bytes(data))


async def test_a_damaged_lease_is_a_corrupt_lease_not_a_take_over(tmp_path):
    """Review 3, claim 14: one damaged byte in the lease read, for its live holder, as a
    take-over ("lost the lease", I7: nobody took it), and for readers as "no record", so
    every COMMIT counted (a stale writer's too). Now: the holder, a reader and a job that
    starts all get CheckpointLeaseCorruptError naming the file; nobody takes the folder over
    it, and no unrecorded COMMIT counts."""
    clock = Clock()
    b = job(tmp_path, clock, "host-b", lease_ttl_s=30.0, keep_last=None)
    b.register("c0", Handle(Comp(101)))
    try:
        assert (await b.save(1)).committed
        lease = tmp_path / ".forge_ckpt.lease"
        _damage(lease)
        clock.t += 11.0  # the next check renews (a third of the TTL passed)
        with pytest.raises(CheckpointLeaseCorruptError, match=r"\.forge_ckpt\.lease"):
            await b.save(2)
        assert b._lease.lost is None  # not told that another job took the folder
        with pytest.raises(CheckpointLeaseCorruptError):
            layout.committed_steps(str(tmp_path))
        clock.t += 100.0  # long expired, if it could be read
        with pytest.raises(CheckpointLeaseCorruptError):
            job(tmp_path, clock, "host-c", lease_ttl_s=30.0, keep_last=None)
    finally:
        b.close()


async def _two_steps(tmp_path: Any) -> Any:
    """A folder with steps 1 and 2 committed by a job now closed; its lease file."""
    b = job(tmp_path, Clock(), "host-b", lease_ttl_s=30.0, keep_last=None)
    b.register("c0", Handle(Comp(101)))
    try:
        for step in (1, 2):
            assert (await b.save(step)).committed
    finally:
        b.close()
    assert layout.committed_steps(str(tmp_path)) == [1, 2]
    return tmp_path / ".forge_ckpt.lease"


async def test_a_damaged_checksum_key_does_not_switch_the_check_off(tmp_path):
    """Review 38: the lease's CRC32C was checked only where its key was present (the first
    leases had none), so one damaged byte in the key's name, plus an edit of the commit
    record, hid a committed step without an error. A lease without the key must now be
    exactly such a first lease: this one is refused, naming the fields that give it away."""
    lease = await _two_steps(tmp_path)
    fields = json.loads(lease.read_text().replace('"crc32c"', '"crc32b"'))
    del fields["committed"]["2"]
    lease.write_text(json.dumps(fields))
    with pytest.raises(CheckpointLeaseCorruptError, match=r"no checksum.*committed, crc32b"):
        layout.committed_steps(str(tmp_path))
    for fields in ({}, {"generation": 9}):  # review 39: a part of the old lease is damage too
        lease.write_text(json.dumps(fields))
        with pytest.raises(CheckpointLeaseCorruptError, match=r"missing: expires"):
            layout.committed_steps(str(tmp_path))


async def test_a_lease_from_before_the_checksum_still_reads(tmp_path):
    """The lease as first written (2026-11-23) had no checksum and no commit record: every
    COMMIT of its folder counts."""
    lease = await _two_steps(tmp_path)
    fields = json.loads(lease.read_text())
    lease.write_text(json.dumps({k: fields[k] for k in lease_record.UNSEALED_FIELDS}))
    assert layout.committed_steps(str(tmp_path)) == [1, 2]


def _slow_renewal_gate(op: str, key: str, mutates: bool) -> str:
    """Armed: the next lease PUT is answered 40 s after it was sent; the abort's batch delete
    of step-1 is held while the successor tries to take over (it lands within its bound)."""
    S3["log"].append((op, key))
    if not S3.get("armed"):
        return "ok"
    if op == "put_object" and key.endswith(".forge_ckpt.lease") and not S3.get("renewed"):
        S3["renewed"] = True
        S3["clock"].t += 40.0
    held: Hold = S3["held"]
    if op == "delete_objects" and "/step-1/" in key and not held.entered.is_set():
        held.entered.set()
        assert held.go.wait(WAIT_S), "the held delete was never let go"
    return "ok"


async def test_s3_a_slow_renewal_is_renewed_again_before_the_delete():
    """Review 3, claim 4 on S3: the abort's fresh renewal PUT was answered 40 s after it was
    sent and counted as fresh; the delete sent next (20 s in flight, within the bound) landed
    after the expiry written at the renewal's send, and removed the successor's step 1. Now
    the slow renewal is renewed again before the delete: the successor is refused while the
    delete is in flight, and keeps what it commits once it takes over."""
    clock = _s3(_slow_renewal_gate)
    held: Hold = S3["held"]
    a = s3_job(clock, "host-a")
    a.register("c0", Handle(FailingWrite(1)))
    clock.t += 5.0  # the save's checks do not renew (ttl/3 = 10 s); the abort's fresh one does
    S3["armed"] = True
    a_save = asyncio.ensure_future(a.save(1))
    b = None
    try:
        await held.reached()
        clock.t += 20.0  # the delete is 20 s in flight: past the slow renewal's expiry
        with pytest.raises(CheckpointLockedError):
            s3_job(clock, "host-b")
        held.go.set()
        with pytest.raises(CheckpointError):
            await a_save
        clock.t += 60.0  # A's lease (renewed again before its delete) expired
        b = s3_job(clock, "host-b")
        b.register("c0", Handle(bcomp := Comp()))
        for step in (1, 2):
            bcomp.version = 200 + step
            assert (await b.save(step)).committed
        bcomp.version = 0
        assert (await b.load(step=1)).step == 1 and bcomp.version == 201
        assert b.steps() == [1, 2]
    finally:
        held.go.set()
        if b is not None:
            b.close()


class _Tier:
    """What close() asks of the memory tier (the real one needs Ray holders)."""

    def __init__(self) -> None:
        self.closed = self.cancelled = False

    def close(self) -> None:
        self.closed = True

    def cancel(self) -> None:
        self.cancelled = True


async def test_close_with_the_memory_tier_never_blocks_behind_a_renewal(tmp_path):
    """Review 4: with the memory tier, close() renewed the lease (a storage call, behind the
    lease mutex a hung renewal held) to decide whether the holders are still this job's. It
    decides from what it knows now (a renewal sent within half a TTL), without a call."""
    coord = CheckpointCoordinator(held_config(tmp_path, lease_ttl_s=0.3))  # renews every 0.1 s
    coord.tier = _Tier()  # type: ignore[assignment]
    assert await _close_behind_a_held_renewal(coord), "close() blocked behind the renewal"
    assert coord.tier.cancelled  # type: ignore[attr-defined]


async def job_with_step_1(folder: Any, clock: Clock) -> CheckpointCoordinator:
    """Job A on host-a (TTL 60 s, every step kept), its component c0 at version 101 and step 1
    committed: the first job of the late-write tests below."""
    a = job(folder, clock, "host-a", lease_ttl_s=60.0, keep_last=None)
    a.register("c0", Handle(Comp(101)))
    assert (await a.save(1)).committed
    return a


async def test_a_stale_preparation_learns_it_lost_the_lease_before_its_actors_write(tmp_path):
    """A job's preparation of step 2 stalled (its last `makedirs` held) past its lease; a
    successor took the folder over and began its own step 2. The stale job's actors then
    wrote into the successor's step, and the successor's create-only write of that file
    failed its save as "another writer" (I7; sim seeds 28030 and 52652, past the budget, on
    the code of the time; the simulation's revert `stale-prepare`). Invariant: the stale job
    learns it lost the lease before its actors write; the successor's step 2 commits. (A
    write already sent when the lease runs out still lands late: the next test.)"""
    clock = Clock()
    a = await job_with_step_1(tmp_path, clock)
    stalled = hold("makedirs", "step-2/trainer")
    a_save = asyncio.ensure_future(a.save(2))
    b = None
    try:
        await stalled.reached()
        clock.t += 90.0  # A's lease expired while its preparation stalled
        b = job(tmp_path, clock, "host-b", lease_ttl_s=60.0, keep_last=None)
        b.register("c0", Handle(comp := Comp(202)))
        b_write = hold("writer", "step-2/actors/c0.0.msgpack")
        b_save = asyncio.ensure_future(b.save(2))
        await b_write.reached()  # B's file is about to be created
        stalled.go.set()  # A's preparation goes on
        with pytest.raises(CheckpointLockedError, match="lost the lease"):
            await a_save
        b_write.go.set()
        assert (await b_save).committed
        comp.version = 0
        got = await b.load(step=2)
        assert got is not None and comp.version == 202
    finally:
        stalled.go.set()
        if b is not None:
            b.close()


async def test_a_late_actor_write_sent_under_the_lease_lands_beside_the_successors_step(
    tmp_path,
):
    """Review 13, claim 4 (and sim seed 13918): an actor's write of step 2, sent while its job
    held the lease (after the preparation's re-check), lands after a successor took the
    folder over and prepared its own step 2. Invariant (I7, I3): the late write cannot break
    the successor's save. Each save attempt's files are named for it (layout.actor_file), so
    the late file lands beside the successor's, outside its manifest; with one name for
    both, the successor's create-only write met it and its save failed once."""
    clock = Clock()
    a = await job_with_step_1(tmp_path, clock)
    a_write = hold("writer", "step-2/actors/c0.0.msgpack")
    a_save = asyncio.ensure_future(a.save(2))
    b = None
    try:
        await a_write.reached()  # sent under the lease, held in flight
        clock.t += 90.0  # meanwhile A's lease runs out
        b = job(tmp_path, clock, "host-b", lease_ttl_s=60.0, keep_last=None)
        b.register("c0", Handle(comp := Comp(202)))
        b_write = hold("writer", "step-2/actors/c0.0.msgpack")
        b_save = asyncio.ensure_future(b.save(2))
        await b_write.reached()  # B prepared its step 2; its file is about to be created
        a_write.go.set()  # A's late write lands in B's step 2
        with pytest.raises(CheckpointError, match="lease"):
            await a_save
        b_write.go.set()
        assert (await b_save).committed
        names = sorted(os.listdir(tmp_path / "step-2" / "actors"))
        assert len(names) == 2  # A's late file beside B's, which alone the manifest lists
        assert [f.path for f in layout.read_committed(str(tmp_path), 2).files] == [
            f"actors/{n}" for n in names if n.split(".")[-2].startswith(f"g{b._lease.generation}s")
        ]
        comp.version = 0
        got = await b.load(step=2)
        assert got is not None and comp.version == 202
    finally:
        a_write.go.set()
        if b is not None:
            b.close()
