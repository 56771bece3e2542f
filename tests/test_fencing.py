"""Fencing: a writer that lost the folder's lease can make no step visible and cannot break its
successor's saves or loads; the lease tells live holders from dead ones by machine and pid
namespace, not by hostname; a lease write applied but answered "precondition failed" on its
retry is recognised as our own. Real local storage, a simulated clock, and Storage wrappers
that hold or fail one operation (the test releases a held one with an Event, never a sleep).
"""

from __future__ import annotations

import builtins
import json
import os
import socket
import subprocess
import sys
import threading
from typing import Any

import pytest
from typer.testing import CliRunner

from forge_ckpt.cli import app
from forge_ckpt.errors import CheckpointCorruptError, CheckpointError, CheckpointLockedError
from forge_ckpt.steps import layout, lease_record
from forge_ckpt.steps.commit import commit_step, prepare_step, remove_step, remove_uncommitted
from forge_ckpt.steps.lock import Lease, _boot_id, _pid_ns
from forge_ckpt.storage import PreconditionFailedError, Storage, crc32c_of_bytes, open_storage


class Clock:
    """Simulated time: moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Wrapped(Storage):
    """A storage that passes every call on to `inner` (subclasses change one)."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.spec = inner.spec

    def sub(self, prefix: str) -> Storage:
        return self.inner.sub(prefix)

    def writer(self, path: str, exclusive: bool = False) -> Any:
        return self.inner.writer(path, exclusive)

    def publish(self, path: str, data: bytes) -> Any:
        return self.inner.publish(path, data)

    def create(self, path: str, data: bytes) -> str:
        return self.inner.create(path, data)

    def replace(self, path: str, data: bytes, tag: str) -> str:
        return self.inner.replace(path, data, tag)

    def read_tagged(self, path: str) -> tuple[bytes, str] | None:
        return self.inner.read_tagged(path)

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytearray:
        return self.inner.read(path, start, end)

    def size(self, path: str) -> int | None:
        return self.inner.size(path)

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self.inner.list(prefix)

    def walk(self, prefix: str = "") -> builtins.list[tuple[str, int]]:
        return self.inner.walk(prefix)

    def delete(self, path: str) -> None:
        self.inner.delete(path)

    def delete_prefix(self, prefix: str) -> None:
        self.inner.delete_prefix(prefix)

    def move_prefix(self, src: str, dst: str, first: str | None = None) -> None:
        self.inner.move_prefix(src, dst, first)

    def makedirs(self, prefix: str) -> None:
        self.inner.makedirs(prefix)

    def sync_dir(self, prefix: str = "") -> None:
        self.inner.sync_dir(prefix)


class HeldCreate(Wrapped):
    """Holds the create of one path until `go` is set: a PUT delayed past the lease's TTL."""

    def __init__(self, inner: Storage, path: str) -> None:
        super().__init__(inner)
        self.path = path
        self.arrived, self.go = threading.Event(), threading.Event()

    def create(self, path: str, data: bytes) -> str:
        if path == self.path:
            self.arrived.set()
            assert self.go.wait(60), "the test never let the held create go"
        return self.inner.create(path, data)


class LostReply(Wrapped):
    """The next lease replace is applied, then answered as its retry would be: 412 (or, with
    `error`, a storage error: the outcome unknown to the writer)."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.lose: type[OSError] | None = None

    def replace(self, path: str, data: bytes, tag: str) -> str:
        lose, self.lose = self.lose, None
        tag = self.inner.replace(path, data, tag)
        if lose is not None:
            raise lose(f"{path}: the reply was lost")
        return tag


def write_step(store: Storage, lease: Lease | None, step: int, extra: str) -> layout.Manifest:
    """A prepared step with one file and its manifest (not committed yet)."""
    prepare_step(store, step)
    rec = store.sub(layout.step_name(step)).write("actors/a.0.msgpack", extra.encode())
    comps = {"a": layout.Component("actor", 1, [rec])}
    gen = lease.generation if lease is not None else 0
    return layout.Manifest(step, comps, extra=extra, generation=gen)


def committed_by(store: Storage, lease: Lease, step: int, extra: str) -> None:
    commit_step(store, write_step(store, lease, step, extra), lease.renew)


def start(store: Storage, clock: Clock) -> Lease:
    lease = Lease(store, 60.0, clock=clock, renew_in_background=False)
    lease.acquire()
    return lease


# ---- 8: a writer that lost the lease -------------------------------------------------------


def commit_in_thread(store: Storage, lease: Lease, manifest: layout.Manifest) -> dict:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            commit_step(store, manifest, lease.renew)
            outcome["result"] = "committed"
        except CheckpointError as e:
            outcome["result"] = e

    outcome["thread"] = threading.Thread(target=run)
    outcome["thread"].start()
    return outcome


def test_late_commit_of_a_taken_over_writer_counts_for_nobody(tmp_path):
    """The first job's COMMIT lands after a second job took the folder over (and before it
    wrote anything): no reader counts it, the first job is told, the second saves step 5."""
    clock, folder = Clock(), str(tmp_path)
    slow = HeldCreate(open_storage(folder), "step-5/COMMIT")
    first = start(slow, clock)
    committed_by(slow, first, 4, "first")
    late = commit_in_thread(slow, first, write_step(slow, first, 5, "first"))
    assert slow.arrived.wait(60)  # its COMMIT is on the way, delayed
    clock.advance(61)  # ... past the lease's TTL: the first job's lease expired
    store = open_storage(folder)
    second = start(store, clock)
    assert second.generation == first.generation + 1
    slow.go.set()  # the delayed COMMIT lands now
    late["thread"].join(60)
    error = late["result"]
    assert isinstance(error, CheckpointLockedError), error
    assert "step 5 is NOT committed" in str(error) and "lost the lease" in str(error)
    assert os.path.exists(os.path.join(folder, "step-5", "COMMIT"))  # there, but it does not count

    reader = open_storage(folder)  # a reader without a lease: load, list, the CLI
    assert layout.committed_steps(reader) == layout.marked_steps(reader) == [4]
    with pytest.raises(CheckpointCorruptError, match="not recorded in the folder's lease"):
        layout.read_committed(reader, 5)
    out = CliRunner().invoke(app, ["list", folder])
    assert out.exit_code == 0 and "commit marker is not recorded" in out.output, out.output

    assert remove_uncommitted(store) == [5]  # the holder removes it as a leftover
    committed_by(store, second, 5, "second")  # and saves that step number itself
    assert layout.committed_steps(reader) == [4, 5]
    assert layout.read_committed(reader, 5).extra == "second"
    with pytest.raises(CheckpointLockedError, match="lost the lease"):
        remove_step(slow, 5)  # the first job can remove nothing of its successor's
    assert layout.read_committed(reader, 5).extra == "second"
    second.release()


@pytest.mark.parametrize("held", ["COMMIT", "manifest.json"])
def test_late_write_lands_in_the_successors_step(tmp_path, held):
    """The first job's delayed manifest or COMMIT lands in the step the second job is saving:
    the second job's commit replaces it and commits; the first job is told it lost."""
    clock, folder = Clock(), str(tmp_path)
    slow = HeldCreate(open_storage(folder), f"step-5/{held}")
    first = start(slow, clock)
    late = commit_in_thread(slow, first, write_step(slow, first, 5, "first"))
    assert slow.arrived.wait(60)
    clock.advance(61)
    store = open_storage(folder)
    second = start(store, clock)
    remove_uncommitted(store)
    manifest = write_step(store, second, 5, "second")  # the successor is saving step 5 ...
    slow.go.set()  # ... when the first job's write lands in its folder
    late["thread"].join(60)
    assert isinstance(late["result"], CheckpointLockedError), late["result"]
    assert not layout.committed_steps(store)
    commit_step(store, manifest, second.renew)
    reader = open_storage(folder)
    assert layout.committed_steps(reader) == [5]
    assert layout.read_committed(reader, 5).extra == "second"
    second.release()


def test_release_hands_the_record_over_and_a_fenced_step_stays_fenced(tmp_path):
    """A release keeps the record; the next job takes it over as it was (a COMMIT the record
    does not hold is not resurrected by the hand-over)."""
    clock, folder = Clock(), str(tmp_path)
    store = open_storage(folder)
    first = start(store, clock)
    committed_by(store, first, 1, "first")
    stray = write_step(store, first, 2, "stray")  # a COMMIT written, never recorded
    store.create("step-2/manifest.json", stray.to_bytes())
    marker = layout.marker_bytes(2, crc32c_of_bytes(stray.to_bytes()), first.generation)
    store.create("step-2/COMMIT", marker)
    first.release()
    second = start(open_storage(folder), clock)
    assert second.generation == first.generation + 1 and set(second.committed) == {1}
    assert layout.committed_steps(folder) == [1]
    second.release()


def test_a_late_commit_of_an_older_generation_under_a_recorded_step_does_not_count(tmp_path):
    """The holder committed step 5 and removed it (its record is dropped lazily); an older
    job's COMMIT of step 5 lands now: the record names another generation, so it is a leftover."""
    clock, folder = Clock(), str(tmp_path)
    store = open_storage(folder)
    first = start(store, clock)
    first.release()
    second = start(store, clock)
    committed_by(store, second, 5, "second")
    remove_step(store, 5)
    assert layout.read_fence(folder).record == {5: second.generation}  # not written yet
    late = write_step(Wrapped(store), None, 5, "first")  # a writer without a lease
    late.generation = first.generation
    store.create("step-5/manifest.json", late.to_bytes())
    marker = layout.marker_bytes(5, crc32c_of_bytes(late.to_bytes()), first.generation)
    store.create("step-5/COMMIT", marker)
    reader = open_storage(folder)
    assert layout.committed_steps(reader) == layout.marked_steps(reader) == []
    with pytest.raises(CheckpointCorruptError, match="late write of a writer that had lost"):
        layout.read_committed(reader, 5)
    assert remove_uncommitted(store) == [5]
    second.release()


def test_a_lease_without_a_record_accepts_every_commit_present(tmp_path):
    """A folder of the first version with a lease (no record, no checksum: the fields of
    `lease_record.UNSEALED_FIELDS`): every COMMIT counts, for readers and for the job that
    takes it over."""
    folder = str(tmp_path)
    store = open_storage(folder)
    for step in (1, 2):
        commit_step(store, write_step(store, None, step, "old"))
    now = Clock().now
    old = {"owner": "o", "host": "h", "pid": 1, "pid_start": "1", "started": now,
           "renewed": now - 120, "expires": now - 60, "generation": 7, "released": False}  # fmt: skip
    with open(os.path.join(folder, layout.LEASE), "w") as f:
        json.dump(old, f)
    assert layout.committed_steps(folder) == [1, 2]
    lease = start(open_storage(folder), Clock())
    assert lease.generation == 8 and set(lease.committed) == {1, 2}
    assert layout.committed_steps(folder) == [1, 2]
    lease.release()


# ---- 7: a lease write applied, its reply lost ----------------------------------------------


def test_renewal_applied_but_answered_412_is_ours(tmp_path):
    clock = Clock()
    store = LostReply(open_storage(str(tmp_path)))
    lease = start(store, clock)
    store.lose = PreconditionFailedError  # applied; the retry got 412
    lease.renew()
    assert lease.held
    store.lose = OSError  # applied; the client gave up: outcome unknown to the lease
    with pytest.raises(OSError):
        lease.renew()
    clock.advance(20)
    lease.renew()  # the lease holds our unknown write: still ours
    store.lose = PreconditionFailedError
    committed_by(store, lease, 1, "x")  # the record write too
    assert lease.held and layout.committed_steps(str(tmp_path)) == [1]
    lease.release()


# ---- 10: hostname is not machine ------------------------------------------------------------


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def write_lease(folder: str, clock: Clock, **changes: Any) -> None:
    lease = {
        "owner": "other", "host": socket.gethostname(), "pid": dead_pid(),
        "pid_start": "12345", "boot_id": _boot_id(), "pid_ns": _pid_ns(),
        "started": clock.now, "renewed": clock.now, "expires": clock.now + 600,
        "generation": 3, "released": False, "committed": {},
    }  # fmt: skip
    lease.update(changes)
    with open(os.path.join(folder, layout.LEASE), "wb") as f:
        f.write(lease_record.seal_lease(lease))


@pytest.mark.parametrize(
    "other", [{"pid_ns": (_pid_ns() or 0) + 1}, {"boot_id": "another-boot"}, {"boot_id": None}]
)
def test_same_hostname_other_container_is_live_until_expiry(tmp_path, other):
    """Another pid namespace (a container with our hostname), another boot, or a lease that
    does not say: its pid means nothing here, so only its expiry frees the folder."""
    clock = Clock()
    write_lease(str(tmp_path), clock, **other)
    store = open_storage(str(tmp_path))
    with pytest.raises(CheckpointLockedError, match="is in use by host"):
        Lease(store, clock=clock, renew_in_background=False).acquire()
    clock.advance(610)  # past its expiry plus the clock-skew allowance (lock.MAX_CLOCK_SKEW_S)
    lease = start(store, clock)
    assert lease.generation == 4
    lease.release()


def test_same_machine_and_namespace_dead_pid_is_taken_over_at_once(tmp_path):
    clock = Clock()
    write_lease(str(tmp_path), clock)
    lease = start(open_storage(str(tmp_path)), clock)
    assert lease.generation == 4
    lease.release()
