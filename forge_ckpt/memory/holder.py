"""The holder: one detached Ray actor per node that keeps copies of checkpoint files in its own
heap (not the object store: an object is lost with the worker that owns it), within a byte
budget, and writes them to the durable tier on request.

Keys are paths relative to the memory tier's root (`step-N/...`). A holder only ever drops a
whole step: the oldest ones beyond `keep` when a put does not fit (never a pinned one: a step
waiting to be persisted), or when asked to.

Bulk bytes come and go over the holder's own listener (`transport.py`: a TCP stream straight
between the two processes, received into the buffer that is kept); Ray calls carry the
control and, for a client that cannot reach the listener, the bytes as before.

The actor is threaded (`max_concurrency`): a persist that writes for minutes, or a large read,
never holds up a put or a control call, so a holder busy persisting never looks dead. One lock
guards the file table; bytes are fetched, checksummed and written outside it.

Fenced: every change carries its writer's token, (claim, save attempt). A driver that opens
the folder (under its lease) claims the run's holders: a claim is (order, nonce), its order
newer than any the holders it sees serve, its nonce its own. A holder takes a claim only over
the one the driver saw there (compare and set) and refuses every other claim's change (a job
that lost the folder's lease shares its successor's holders). A step's files belong to one
save attempt (`fences`): a newer attempt's first call drops an older one's files of that
step, and an older attempt's late write is refused (its late removal leaves the step alone).
See docs/tiers.md.
"""

from __future__ import annotations

import errno
import re
import threading
from typing import Any

import numpy as np
import ray

from ..errors import CheckpointError
from ..storage.base import (
    ANOTHER,
    AlreadyExistsError,
    Checksums,
    FileRecord,
    StorageError,
    StorageSpec,
    check_record,
    checksums_of,
    crc32c_of_bytes,
)
from .cluster import current
from .transport import CREATE_ONLY, FENCE, Server

_STEP_RE = re.compile(r"^step-(\d+)(/|$)")
MAX_CONCURRENCY = 16  # calls a holder serves at once (puts of many writers, reads, a persist)
# A holder refuses bytes that differ from what their writer checksummed: not a damaged stored
# file, so not the default advice (verify the step folder, load an older step).
SENT_CHANGED = (
    "the bytes sent differ from what the writer checksummed: its state changed while it was "
    "being saved (an actor must not change the state it returned from `state_dict()` until "
    "the save ends; hand back copies if another thread keeps changing it), or they were "
    "damaged on the way. Nothing of the file was kept: the save fails, the newest committed "
    "step is unchanged, and the next save may be tried"
)
MAX_FENCES = 4096  # steps whose attempt a holder remembers (beyond: the longest ago go first)
Claim = tuple[int, int]  # an opening of the folder: (order, nonce); (0, 0): none
Token = tuple[int, int, int]  # a writer's (claim order, claim nonce, save attempt; 0: any)
NO_CLAIM: Claim = (0, 0)


class MemoryBudgetError(CheckpointError):
    """A file does not fit in a holder's budget even after dropping its older steps."""


class StaleWriteError(StorageError):
    """A holder refused a change from a writer that is fenced off: a job that lost the
    folder's lease, or a late call of an earlier attempt of a save."""


def token_of(value: Any) -> Token | None:
    """A token as it travels (a tuple, or a list through the stream's header), or None."""
    if value is None:
        return None
    order, nonce, attempt = value
    return int(order), int(nonce), int(attempt)


def claim_of(value: Any) -> Claim:
    """A claim as it travels (a tuple or a list), or NO_CLAIM."""
    return NO_CLAIM if not value else (int(value[0]), int(value[1]))


def step_of(key: str) -> int | None:
    m = _STEP_RE.match(key)
    return int(m.group(1)) if m else None


class Holder:
    """Keeps files by key. Calls run concurrently (threads); every change of `files` and every
    decision on it (room, create-if-absent, replace-if-tag) is made under `_lock`."""

    def __init__(
        self,
        run_id: str,
        fingerprint: str,
        budget: int,
        keep: int,
        incarnation: str = "",
        listen: bool = True,
    ) -> None:
        """`listen=False`: no direct listener (the simulation's holders; clients use the
        holder's calls for the bytes, as they do when a stream fails)."""
        self.run_id, self.fingerprint, self.incarnation = run_id, fingerprint, incarnation
        self.budget, self.keep = budget, keep
        self.files: dict[str, bytes | bytearray] = {}
        self.pinned: set[int] = set()  # steps waiting to be persisted: never dropped for room
        self.claim: Claim = NO_CLAIM  # the opening of the folder this holder serves
        self.fences: dict[int, Token] = {}  # step -> the save attempt its files here are of
        self.persisting = 0  # persists in progress (for info())
        self._lock = threading.Lock()
        self.node_id = current().node_id()
        self._server: Server | None = None
        self.serve(listen)

    def serve(self, on: bool = True) -> dict[str, Any] | None:
        """Start (or stop) the direct listener on this node's address; its endpoint. (Stopped:
        clients fall back to Ray's object store, as tests check.)"""
        if self._server is not None and not on:
            self._server.stop()
            self._server = None
        elif self._server is None and on:
            self._server = Server(ray.util.get_node_ip_address(), self)
        return self.endpoint()

    def endpoint(self) -> dict[str, Any] | None:
        """Where to stream bytes to and from this holder (None: use Ray)."""
        return None if self._server is None else self._server.endpoint.to_dict()

    def info(self) -> dict[str, Any]:
        with self._lock:
            used = sum(len(v) for v in self.files.values())
            return {"run_id": self.run_id, "fingerprint": self.fingerprint,
                    "incarnation": self.incarnation, "node_id": self.node_id, "used": used,
                    "budget": self.budget, "files": len(self.files),
                    "pinned": sorted(self.pinned), "persisting": self.persisting,
                    "claim": list(self.claim)}  # fmt: skip

    def configure(
        self, budget: int, keep: int, claim: Any = None, over: Any = None, wipe: bool = False
    ) -> dict[str, Any]:
        """A restarted driver's budget and keep apply to the holders it finds; the pins of a
        driver that died mid-persist are dropped (its persist will never finish). `claim`:
        the driver's opening of the folder, taken over `over`, the claim it saw here (None:
        a driver of an earlier release, unfenced); from here on, every other claim's change
        is refused. `wipe`: taken from another claim by a later look, the files go (they may
        hold a stale job's late COMMIT, landed after the opening's look missed this holder:
        review 29)."""
        mine, seen = claim_of(claim), claim_of(over)
        with self._lock:
            taken = claim is not None and self.claim != mine
            if claim is not None:  # (one that serves our claim already keeps its pins)
                self._claim(mine, seen)
            if taken and wipe and seen != NO_CLAIM:  # (only from another one: a second look
                self.files.clear()  # of ours wipes nothing, review 30)
                self.fences.clear()
            self.budget, self.keep = budget, keep
            if claim is None or taken:
                self.pinned.clear()
        return self.info()

    def _claim(self, claim: Claim, over: Claim) -> None:
        """Compare and set (the caller holds the lock): a driver's configure that lands after
        another opening claimed this holder since the driver looked is refused."""
        if self.claim not in (claim, over):
            raise StaleWriteError(
                f"{self._at()} (run {self.run_id}): another opening of the "
                f"folder, {self.claim}, claimed it since this job's, {claim}, looked: this "
                "job lost the folder's lease, or two opened at once (open the folder again)"
            )
        self.claim = claim

    def _at(self, key: str = "") -> str:
        """Where a refusal happened, for its message."""
        return f"mem holder {self.node_id[:8]}" + (f":{key}" if key else "")

    def fence(self, step: int, token: Any) -> None:
        """A save attempt prepares `step`: the step's files of an older attempt go, and that
        attempt's late writes are refused from now on."""
        with self._lock:
            self._admit(self._at(f"step-{step}"), token, step, True)

    def _admit(self, where: str, token: Any, step: int | None, write: bool) -> bool:
        """Whether the writer of `token` may change `step` here (the caller holds the lock).
        Raises StaleWriteError for a writer fenced off; False for an earlier attempt's
        removal (the step is a newer attempt's now: left alone). No token: a caller of an
        earlier release, admitted as before."""
        t = token_of(token)
        if t is None:
            return True
        if t[:2] != self.claim:
            raise StaleWriteError(
                f"{where}: refused: its writer's opening of the folder {t[:2]} is not the "
                f"one this holder serves, {self.claim}, which a job that took the folder "
                "over since made (this job lost the folder's lease: it must stop saving; its "
                "successor's steps are untouched)"
            )
        cur = self.fences.get(step) if step is not None and t[2] else None
        if cur is not None and cur[:2] != t[:2]:  # another opening's attempt: no order
            cur = None  # between the two (review 28); its files go as an older one's
        if step is None or not t[2] or t == cur:
            return True
        if cur is not None and t < cur:
            if not write:
                return False
            raise StaleWriteError(
                f"{where}: refused: a late write of save attempt {t[2]} of step {step}, "
                f"which is attempt {cur[2]}'s now (a retry of the save; nothing of it is "
                "touched)"
            )
        if write:
            self._adopt(where, step, t)
        return True

    def _adopt(self, where: str, step: int, t: Token) -> None:
        """A newer attempt owns `step` here: an older one's files of it go."""
        if f"step-{step}/COMMIT" in self.files:
            raise AlreadyExistsError(
                errno.EEXIST, f"{where}: step {step} is committed here; save a new step number"
            )
        self._delete_prefix(f"step-{step}")
        self.fences.pop(step, None)  # (the table is in the order the steps were fenced)
        self.fences[step] = t
        if len(self.fences) > MAX_FENCES:  # those fenced longest ago that hold nothing go
            held = {step_of(k) for k in self.files}
            for old in list(self.fences)[: len(self.fences) // 2]:
                if old not in held:
                    del self.fences[old]

    def pin(self, step: int, on: bool = True, token: Any = None) -> None:
        """Keep `step` (or stop keeping it) whatever room a put needs: it is being persisted."""
        with self._lock:
            self._admit(self._at(), token, None, True)
            if on:
                self.pinned.add(step)
            else:
                self.pinned.discard(step)

    def put(self, key: str, refs: list[Any], record: dict) -> int:
        """Fetch the writer's object (Ray moves it node to node), check it, keep it: the path
        when the direct stream cannot be used. A small file comes as bytes in the call."""
        data = refs[0] if isinstance(refs[0], bytes) else current().get(refs[0])
        buf = bytes(data) if not isinstance(data, bytes) else data
        rec = FileRecord.from_dict(record)
        self.accept(key, buf, checksums_of(buf, _algo(rec)), record)
        return len(buf)

    def room_for(self, key: str, size: int) -> None:
        """Before a streamed put's bytes: refuse a file that can never fit."""
        if size > self.budget:  # dropping older steps would not help
            with self._lock:
                raise self._too_big(key, size, sum(map(len, self.files.values())))

    def accept(self, key: str, buf: bytes | bytearray, sums: Checksums, record: dict) -> None:
        """Check the received bytes (checksummed as they came) against the writer's record,
        then keep them, making room."""
        rec = FileRecord.from_dict(record)
        where = self._at(key)
        check_record(where, sums.size, f"{sums.crc:08x}", rec, sums.record(key),
                     source="the writer's record", hint=SENT_CHANGED)  # fmt: skip
        with self._lock:
            self._admit(where, record.get(FENCE), step_of(key), True)
            old = self.files.get(key)
            if record.get(CREATE_ONLY) and old is not None and not _is(old, rec.size, rec.crc32c):
                # a stale job's late write (it shares its successor's holders): never over
                # a file of the successor's step (review 20); the same bytes are a retry's
                raise AlreadyExistsError(errno.EEXIST, f"{where} already exists: {ANOTHER}")
            self._make_room(key, len(buf))
            self.files[key] = buf

    def view(
        self, key: str, start: int, end: int | None, limit: int | None
    ) -> tuple[int | None, memoryview | None]:
        """(file size, bytes [start, end)) for a streamed read; no bytes when the range is
        longer than `limit`; (None, None) when absent."""
        with self._lock:
            data = self.files.get(key)
        if data is None:
            return None, None
        view = memoryview(data)[start:end]
        return len(data), (None if limit is not None and len(view) > limit else view)

    def _make_room(self, key: str, size: int) -> None:
        """Drop whole steps older than the newest `keep` (never a pinned one) until `size`
        bytes fit; the caller holds the lock."""
        used = sum(len(v) for k, v in self.files.items() if k != key)
        if used + size <= self.budget:
            return
        steps = sorted({s for s in map(step_of, self.files) if s is not None})
        mine = step_of(key)
        for old in steps[: max(len(steps) - self.keep, 0)]:
            if old == mine or old in self.pinned:
                continue
            self._drop(old)
            used = sum(len(v) for k, v in self.files.items() if k != key)
            if used + size <= self.budget:
                return
        raise self._too_big(key, size, used)

    def _too_big(self, key: str, size: int, used: int) -> MemoryBudgetError:
        pinned = f", and step(s) {sorted(self.pinned)} wait to be persisted" if self.pinned else ""
        return MemoryBudgetError(
            f"memory holder on node {self.node_id} (run {self.run_id}): {key} ({size} bytes) "
            f"does not fit: {used} of {self.budget} bytes are used by the newest "
            f"{self.keep} step(s){pinned}. Raise CheckpointConfig.memory_budget_bytes or lower "
            "memory_keep"
        )

    def create(self, key: str, data: bytes, overwrite: bool = False, token: Any = None) -> bool:
        """Small control files (manifest, COMMIT): False if present and not `overwrite`."""
        with self._lock:
            self._admit(self._at(key), token, step_of(key), True)
            if key in self.files and not overwrite:
                return False
            self.files[key] = bytes(data)
            return True

    def replace(self, key: str, data: bytes, tag: str, token: Any = None) -> str | None:
        with self._lock:
            self._admit(self._at(key), token, step_of(key), True)
            cur = self.files.get(key)
            if cur is None or crc32c_of_bytes(cur) != tag:
                return None
            self.files[key] = bytes(data)
            return crc32c_of_bytes(data)

    def get(
        self, key: str, start: int = 0, end: int | None = None, limit: int | None = None
    ) -> np.ndarray | int | None:
        """A view of the bytes: Ray sends a numpy array out of band (into the object store
        once, read without a copy by a reader on this node), where bytes are pickled. A
        range longer than `limit` is answered with the file's size (the reader then splits
        it over the copies)."""
        with self._lock:
            data = self.files.get(key)
        if data is None:
            return None
        view = np.frombuffer(data, dtype=np.uint8)[start:end]
        return len(data) if limit is not None and len(view) > limit else view

    def has(self, keys: list[str], records: list[tuple[int, str]] | None = None) -> list[bool]:
        """Which of `keys` this holder keeps; with `records` ((size, crc32c) per key), only
        copies that match them (a stale job's late write may have left another file)."""
        with self._lock:
            found = [self.files.get(k) for k in keys]
        if records is None:
            return [d is not None for d in found]
        return [d is not None and _is(d, *r) for d, r in zip(found, records, strict=True)]

    def sizes(self, prefix: str = "") -> dict[str, int]:
        with self._lock:
            return {k: len(v) for k, v in self.files.items() if k.startswith(prefix)}

    def rename(self, src: str, dst: str, token: Any = None) -> bool:
        """False if this holder has no copy of `src`."""
        with self._lock:
            where = self._at(dst)
            if not self._removes(where, src, token) or not self._admit(where, token,
                                                                        step_of(dst), True):  # fmt: skip
                return False
            data = self.files.pop(src, None)
            if data is None:
                return False
            self.files[dst] = data
            return True

    def delete(self, key: str, token: Any = None) -> None:
        with self._lock:
            if self._removes(key, key, token):
                self.files.pop(key, None)

    def delete_prefix(self, prefix: str, token: Any = None) -> None:
        with self._lock:
            if self._removes(prefix, prefix, token):
                self._delete_prefix(prefix)

    def _removes(self, where: str, key: str, token: Any) -> bool:
        """Whether a removal of `key` (or of the files under it) by `token`'s writer goes
        ahead: a fenced-off job's raises, an earlier attempt's late one is skipped."""
        return self._admit(self._at(where), token, step_of(key), False)

    def _delete_prefix(self, prefix: str) -> None:
        for k in [k for k in self.files if k == prefix or k.startswith(prefix.rstrip("/") + "/")]:
            del self.files[k]

    def drop_step(self, step: int, token: Any = None) -> None:
        with self._lock:
            if self._removes(f"step-{step}", f"step-{step}", token):
                self._drop(step)

    def _drop(self, step: int) -> None:
        """COMMIT first, so that this holder never offers a half-dropped step as whole."""
        self.files.pop(f"step-{step}/COMMIT", None)
        self._delete_prefix(f"step-{step}")

    def open_durable(self, spec: StorageSpec) -> Any:
        """The durable storage a persist writes to (a seam: tests hold its writes)."""
        from ..storage import open_storage

        return open_storage(spec)

    def persist(self, spec: StorageSpec, keys: list[tuple[str, str]]) -> list[dict]:
        """Write (key -> path) to the durable storage `spec` from this holder's copies;
        returns the written records (the driver checks them against the manifest). Runs
        beside other calls: only the lookup of each file's bytes takes the lock."""
        store = self.open_durable(spec)
        out = []
        with self._lock:
            self.persisting += 1
        try:
            for key, path in keys:
                with self._lock:
                    data = self.files.get(key)
                if data is None:
                    raise FileNotFoundError(f"memory holder on node {self.node_id}: {key} is gone")
                out.append(store.write(path, data, exclusive=True).to_dict())  # a step's file
        finally:
            with self._lock:
                self.persisting -= 1
        return out


def _algo(rec: FileRecord) -> str | None:
    return None if rec.digest is None else rec.digest.split(":", 1)[0]


_OPTIONS: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0, "max_concurrency": MAX_CONCURRENCY}
HolderActor: Any = ray.remote(**_OPTIONS)(Holder)


def _is(data: bytes | bytearray, size: int, crc32c: str) -> bool:
    """Whether `data` is the file of this size and CRC32C (a copy's identity)."""
    return len(data) == size and crc32c_of_bytes(data) == crc32c
