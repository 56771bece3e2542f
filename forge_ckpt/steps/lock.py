"""One writer per checkpoint folder: a lease, because flock means nothing between machines,
is unreliable on NFS and does not exist on object stores. The lease is also the folder's
commit record: the fence that keeps a writer that lost it from making a step visible.

The lease is one object, `<folder>/.forge_ckpt.lease`, holding the holder (host, pid, start
time, boot id and pid namespace), an expiry, a generation number and the commit record
(`committed`: step -> lease generation of that step's COMMIT marker).

Taking it: read the lease (content and version tag); if it is live, CheckpointLockedError.
Else take over the previous record (or, if the lease has none: an earlier release's, or no
lease, record every COMMIT present now, read after the lease), then write generation + 1
with a create-if-absent or a replace-if-unchanged (that tag): of two jobs racing exactly one
wins. A lease is live until its expiry, unless it was released, or its holder is a process of
this machine and pid namespace (same boot id and pid namespace) that is gone.

Committing (commit.commit_step): the manifest, then COMMIT, then the step goes into the record
with a conditional replace (`record`): that write is the commit point. A holder that was
taken over meanwhile fails it (its tag changed), learns that its step is NOT committed, and
its COMMIT, recorded nowhere, counts for no reader (layout.Fence; the record names each
step's generation, so an older job's COMMIT landing late under a recorded step number does not
count either). Its successor took over the
record as it was when it read the lease; a record write of the old holder after that read
would have changed the tag and failed the successor's take-over. So every reader sees exactly
the steps whose record write succeeded, and a successor can remove and save again any step
number whose COMMIT is not recorded.

Keeping it: renewed every `ttl/3` from a thread (or by the caller: renew_in_background=False)
with the same conditional replace. A replace that the storage applied but whose reply was lost
reads as "precondition failed" on the retry: the lease then reads its own content back, and if
it is what this lease wrote, keeps going. Releasing marks it released, keeping generation and
record, so the next job takes it at once.
"""

from __future__ import annotations

import contextvars
import errno
import functools
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointLeaseCorruptError, CheckpointLockedError
from ..storage import AlreadyExistsError, PreconditionFailedError, Storage, StorageError
from . import layout, lease_record
from .layout import LEASE

log = logging.getLogger("forge_ckpt")
_LEASES: weakref.WeakSet[Lease] = weakref.WeakSet()  # acquired by this process, not released


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of a process (tells a live pid from a reused one)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@functools.cache  # (a process outlives neither its boot nor its pid namespace)
def _boot_id() -> str | None:
    """This machine's boot (a pid of this machine means nothing on another or after a reboot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


@functools.cache
def _pid_ns() -> int | None:
    """This process's pid namespace: containers sharing a hostname still have their own."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


# The lease of the coordinator whose call is running (set around each of its storage calls):
# two coordinators of one process on one folder (a test, the simulation) each use their own.
# A renewal this recent counts as fresh: a call sent now lands within its bound of it.
FRESH_S = 1.0
# A lease written by another machine counts as live until its expiry plus this much on the
# reader's clock: the expiry was computed on the writer's clock. The fence's margin (TTL -
# call bound - FRESH_S) is then kept with the two clocks up to this far apart (docs/protocol.md).
MAX_CLOCK_SKEW_S = 5.0

CURRENT: contextvars.ContextVar[Lease | None] = contextvars.ContextVar(
    "forge_ckpt_lease", default=None
)


def lease_of(store: Storage) -> Lease | None:
    """The caller's lease on this storage object: the running coordinator's, else the one this
    process took (open_storage caches one per folder) and did not release: the held one, else
    one lost to another job. The commit functions record and check through it."""
    current = CURRENT.get()
    if current is not None and current.store is store:
        return current
    mine = [lease for lease in list(_LEASES) if lease.store is store]
    return next((lease for lease in mine if lease.held), mine[0] if mine else None)


class Lease:
    def __init__(
        self,
        store: Storage,
        ttl_s: float = 60.0,
        *,
        clock: Callable[[], float] = time.time,
        renew_in_background: bool = True,
        identity: dict[str, Any] | None = None,
        lock: Callable[[], Any] = threading.Lock,
        clock_skew_s: float = MAX_CLOCK_SKEW_S,
    ) -> None:
        """`clock` decides every expiry (a simulation passes its own); without
        `renew_in_background` no thread is started and the caller renews; `identity`
        stands for this machine's host, pid, boot and pid namespace in the lease (the
        simulation's processes each have their own); `lock` makes its mutex (held across
        storage calls); `clock_skew_s`: how far another machine's clock may be from ours."""
        if clock_skew_s < 0:
            raise ValueError(f"max_clock_skew_s must be >= 0, got {clock_skew_s}")
        self.store = store
        self.ttl_s = ttl_s
        self.clock_skew_s = clock_skew_s
        self.clock = clock
        self.generation = 0
        self.committed: dict[int, int | None] = {}  # the record: step -> its COMMIT's generation
        self._background = renew_in_background
        self._identity = identity
        self._owner = uuid.uuid4().hex
        self._started = clock()
        self._tag: str | None = None
        self._renewed = 0.0  # clock() when the last successful write was sent (its expiry's base)
        # Writes whose outcome is unknown (storage errors) since the last one known to land:
        # any of them may be what the folder now holds.
        self._unsure: list[bytes] = []
        self._written: set[int] = set()  # steps the lease object may record now
        self._lost: str | None = None
        self._mutex = lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._tag is not None and self._lost is None

    def renewed_within(self, seconds: float) -> bool:
        """Held, and its last renewal was sent less than `seconds` ago: what this job knows
        without a storage call (nobody else can hold the folder before that renewal's expiry)."""
        return self.held and self.clock() - self._renewed < seconds

    @property
    def lost(self) -> str | None:
        """Why this lease was lost to another job (None: it was not)."""
        return self._lost

    def _content(self, generation: int, expires: float, released: bool = False) -> bytes:
        pid = os.getpid()
        return lease_record.seal_lease(
            {
                "owner": self._owner,
                **(
                    self._identity
                    or {
                        "host": socket.gethostname(),
                        "pid": pid,
                        "pid_start": _proc_start(pid),
                        "boot_id": _boot_id(),
                        "pid_ns": _pid_ns(),
                    }
                ),
                "started": self._started,
                "renewed": self.clock(),
                "expires": expires,
                "generation": generation,
                "released": released,
                "committed": {str(s): c for s, c in sorted(self.committed.items())},
            }
        )

    def acquire(self) -> None:
        """Take the lease or raise CheckpointLockedError naming its live holder."""
        for _ in range(3):
            current = self.store.read_tagged(LEASE)
            # A damaged lease is an error, never expired: taking the folder over it would
            # count every COMMIT (a stale writer's too) and drop the fence.
            holder = (
                lease_record.parse_lease(current[0], self.store.where(LEASE)) if current else {}
            )
            if current is not None and _is_live(holder, self.clock(), self.clock_skew_s):
                raise CheckpointLockedError(
                    f"checkpoint folder {self.store.url} is in use by {_describe(holder)}; "
                    "stop that job or use another folder (if it is dead, its lease "
                    "expires at the time shown)"
                )
            gen = _generation(holder) + 1
            record = lease_record.parse_record(holder)  # listed after the read: see the docstring
            self.committed = layout.record_of_markers(self.store) if record is None else record
            sent = self.clock()
            data = self._content(gen, sent + self.ttl_s)
            try:
                if current is None:
                    tag = self.store.create(LEASE, data)
                else:
                    tag = self.store.replace(LEASE, data, current[1])
            except (AlreadyExistsError, PreconditionFailedError):
                mine = self._own_write(data)  # applied, but its reply was lost
                if mine is None:
                    continue  # another job moved first: look again
                tag = mine
            self._tag, self.generation, self._renewed = tag, gen, sent
            self._lost, self._written = None, set(self.committed)
            _LEASES.add(self)
            self._start_renewals()
            return
        raise CheckpointLockedError(
            f"checkpoint folder {self.store.url}: lost every race for the lease"
        )

    def _start_renewals(self) -> None:
        self._stop.clear()
        if not self._background:
            return
        self._thread = threading.Thread(
            target=self._renew_loop, daemon=True, name="forge-ckpt-lease"
        )
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                with self._mutex:
                    if self._stop.is_set():  # released meanwhile: write nothing more
                        return
                    self._write()
            except (CheckpointLockedError, CheckpointLeaseCorruptError) as e:
                log.error("%s", e)
                return
            except OSError as e:  # storage unreachable: keep trying until the lease expires
                log.warning("could not renew the lease on %s: %s", self.store.url, e)

    def renew(self) -> None:
        """Extend the lease (conditional on nobody having taken it over)."""
        with self._mutex:
            self._write()

    def check(self, fresh: bool = False) -> None:
        """Raise CheckpointLockedError if the lease is known lost; renew it if its last
        renewal is older than `ttl/3` (a holder that stalled learns now that it was taken over).
        `fresh`: renew now, before a call that removes or moves files: such a call may land as
        late as the storage's call bound after it is sent, and must land while the lease
        still holds (a bound under the TTL, counted from this renewal, not from an older one).
        A renewal counts from when it was sent (the expiry it wrote): one whose reply came
        late is not fresh, and is renewed again (three tries, then a StorageError)."""
        with self._mutex:
            self._check_held()
            limit = FRESH_S if fresh else self.ttl_s / 3
            for _ in range(3 if fresh else 1):
                if self.clock() - self._renewed < limit:
                    return
                self._write()
            if fresh and self.clock() - self._renewed >= limit:
                raise StorageError(
                    errno.ETIMEDOUT,
                    f"{self.store.where(LEASE)}: three renewals of the lease in a row were "
                    f"answered more than {FRESH_S} s after they were sent: too slow to fence a "
                    "removal, so nothing is removed (the folder's holder removes leftovers)",
                )

    def record(self, step: int, generation: int) -> None:
        """Record `step`'s COMMIT (of lease `generation`) in the lease: the commit point.
        CheckpointLockedError if the lease was lost: the step is then NOT committed (its COMMIT
        counts for no reader). On a storage error the outcome is unknown; it stays recorded
        here (the next renewal writes it), so a step that became visible does not vanish."""
        with self._mutex:
            previous = self.committed.copy()
            self.committed[step] = generation
            try:
                self._write()
            except CheckpointLockedError as e:
                self.committed = previous
                raise CheckpointLockedError(
                    f"step {step} is NOT committed: its COMMIT was written, but this job lost "
                    f"the lease before recording it ({e}); no reader counts that COMMIT and the "
                    "folder's holder removes it"
                ) from None

    def forget(self, steps: list[int], write: bool = False) -> None:
        """Drop removed steps from the record: written with the next renewal, or now with
        `write` if the lease object may still record one of them."""
        with self._mutex:
            for s in steps:
                self.committed.pop(s, None)
            if write and self._written.intersection(steps):
                self._write()

    def settle_record(self) -> None:
        """Write the lease now if the folder's copy of the record may differ from this one
        (a record write whose outcome is unknown: the next renewal would land it). A caller
        that decides from the folder whether a step committed then reads what stays; a
        step is never dropped from the record on such a read (a late write of it could
        still land: review 11)."""
        with self._mutex:
            if self._unsure or self._written != set(self.committed):
                self._write()

    def _check_held(self) -> None:
        if self._lost is not None:
            raise CheckpointLockedError(self._lost)
        if self._tag is None:
            raise CheckpointLockedError(f"{self.store.url}: the lease is not held")

    def _write(self) -> None:
        """Replace the lease with this holder's current content (mutex held)."""
        self._check_held()
        sent = self.clock()  # the expiry counts from here, and so does the renewal
        data = self._content(self.generation, sent + self.ttl_s)
        try:
            tag = self.store.replace(LEASE, data, self._tag)  # type: ignore[arg-type]
        except PreconditionFailedError:
            mine = self._own_write(data)
            if mine is None:
                self._lose()
                raise CheckpointLockedError(self._lost) from None
            tag = mine
        except OSError:
            self._unsure.append(data)
            self._written |= set(self.committed)
            raise
        self._tag, self._unsure, self._renewed = tag, [], sent
        self._written = set(self.committed)

    def _own_write(self, data: bytes) -> str | None:
        """After "precondition failed": the lease's tag if it holds `data` (our write applied,
        its reply lost) or rewritten over an earlier write of ours whose outcome was unknown."""
        current = self.store.read_tagged(LEASE)
        if current is None:
            return None
        if current[0] == data:
            return current[1]
        if current[0] in self._unsure:
            try:
                return self.store.replace(LEASE, data, current[1])
            except PreconditionFailedError:
                return None
            except OSError:  # this write's outcome is unknown too
                self._unsure.append(data)
                raise
        return None

    def _lose(self) -> None:
        """The lease changed under this holder: taken over, or damaged (then an error that
        says so: nobody took the folder, I7, but no write of this job can be fenced)."""
        current = self.store.read_tagged(LEASE)
        where = self.store.where(LEASE)
        who = (
            _describe(lease_record.parse_lease(current[0], where))
            if current
            else "nobody (it was deleted)"
        )
        self._lost = (
            f"lost the lease on {self.store.url} (generation {self.generation}): it was "
            f"taken over by {who}; this job must stop writing the folder"
        )

    def release(self) -> None:
        """Mark the lease released (the next job takes it at once); keeps the generation and
        the record. Never blocks: with a renewal in flight (its mutex held across a storage
        call that may hang), the release is written by a thread once that renewal ends; the
        renewal thread writes nothing after this. This process counts the lease as free at
        once, and still does if the write fails (a read-only disk)."""
        _LEASES.discard(self)
        self._stop.set()
        self._thread = None
        if self._mutex.acquire(blocking=False):
            try:
                self._write_release()
            finally:
                self._mutex.release()
        elif self._background:
            threading.Thread(
                target=self._release_later, daemon=True, name="forge-ckpt-lease-release"
            ).start()
        else:  # a caller-renewed lease (the simulation): its lock waits without blocking
            self._release_later()

    def _release_later(self) -> None:
        with self._mutex:
            self._write_release()

    def _write_release(self) -> None:
        """Write the released lease (mutex held)."""
        if self._tag is not None and self._lost is None:
            data = self._content(self.generation, self.clock(), released=True)
            try:
                self.store.replace(LEASE, data, self._tag)
            except PreconditionFailedError as e:
                if self._own_write(data) is None:
                    log.warning("could not release the lease on %s: %s", self.store.url, e)
            except OSError as e:
                log.warning("could not release the lease on %s: %s", self.store.url, e)
        self._tag = None


def _generation(holder: dict[str, Any]) -> int:
    try:
        return int(holder.get("generation", 0))
    except (TypeError, ValueError):
        return 0


def _same_process_table(holder: dict[str, Any]) -> bool:
    """The holder's pid means a process we can see: same machine boot, same pid namespace."""
    boot, ns = _boot_id(), _pid_ns()
    return (
        boot is not None
        and ns is not None
        and holder.get("boot_id") == boot
        and holder.get("pid_ns") == ns
        and holder.get("pid_start") is not None
    )


def _is_live(holder: dict[str, Any], now: float, skew: float) -> bool:
    """Whether `holder` still holds the lease at `now` on our clock; `skew`: how far another
    machine's clock, on which its expiry was computed, may be behind ours."""
    try:
        expires = float(holder.get("expires", 0))
    except (TypeError, ValueError):
        return False
    here = _same_process_table(holder)  # this machine: one clock, no skew
    if not holder or holder.get("released") or expires < now - (0.0 if here else skew):
        return False
    if here:
        pid = int(holder["pid"])
        if pid == os.getpid() and holder.get("pid_start") == _proc_start(pid):
            # this process knows which of its leases live
            return any(lease._owner == holder.get("owner") and lease.held for lease in _LEASES)
        # A holder of this machine and pid namespace whose process is gone (or whose pid was
        # reused) is dead now, not at its expiry: a restarted job takes over at once.
        return _proc_start(pid) == holder["pid_start"]
    return True  # another machine or container: only its expiry tells


def _describe(holder: dict[str, Any]) -> str:
    try:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
        expires = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["expires"]))
        return (
            f"host {holder['host']}, pid {holder['pid']}, started {started} (lease "
            f"generation {holder['generation']}, expires {expires})"
        )
    except (KeyError, TypeError, ValueError):
        return "another process (holder unknown)"
