"""`MemoryStorage`: the `mem://<run_id>` backend, so every unit writes the memory tier through
the same seam (`open_storage(spec)`) as a folder, with no protocol of its own.

A writer buffers its file and checksums it as every writer does; `close()` streams the bytes
straight to `copies` holders on other nodes at once (`transport.py`), which receive them into
the buffer they keep, checksumming as they arrive, check size and crc32c against the record
and ack. A holder that cannot be reached directly (no listener, a cut stream) while Ray says
it lives gets the bytes the old way: `ray.put` in the writer, pulled node to node by the holder.
Reads stream from a holder into one preallocated buffer, with the same fallback.
Control files (manifest, COMMIT) go to every live holder. There is no lease and no atomic
create across holders: the durable folder's lease already makes the coordinator the only
writer (see docs/tiers.md). Reads ask any live holder that has the file.
"""

from __future__ import annotations

import builtins
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from ..errors import CheckpointCorruptError
from ..storage.base import (
    AlreadyExistsError,
    Checksums,
    FileRecord,
    PreconditionFailedError,
    Storage,
    StorageError,
    StorageSpec,
    Writer,
    check_record,
    crc32c_of_bytes,
    expected_algo,
    join,
)
from . import transport
from .calls import _DEAD, DEAD, HolderCalls
from .cluster import current
from .holder import token_of
from .placement import HolderRef, preference

log = logging.getLogger("forge_ckpt")
SCHEME = "mem://"
OPTIONS = ("holders", "copies", "namespace", "digest", "fence")
CALL_TIMEOUT_S = 300.0
READ_CHUNK = 32 * 1024**2  # a read from other nodes of 2 of these or more is spread
# A file up to this size rides in the holder call itself (Ray inlines small arguments): no
# object store entry, no location lookup and pull by the holder.
INLINE_MAX = 64 * 1024


_GONE = object()  # a read's holder is dead


class _LostMidRead(Exception):
    """A holder no longer had the file when its part was read."""


def _unwrap(e: BaseException) -> BaseException:
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


class MemoryStorage(HolderCalls, Storage):
    # No lease of its own: the coordinator's lease on the durable folder fences its commits
    # (commit._borrowed: a stale writer's leftover manifest or COMMIT is replaced under it).
    fenced_by_caller = True

    def __init__(self, spec: StorageSpec) -> None:
        unknown = sorted(set(spec.options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown mem:// options {unknown}; known: {sorted(OPTIONS)}")
        self.spec = spec
        rest = spec.url.removeprefix(SCHEME)
        self.run_id, _, self.prefix = rest.partition("/")
        if not spec.options.get("holders"):
            raise ValueError(
                f"{spec.url}: a memory tier is opened from its coordinator's spec (it lists the "
                "holders); set CheckpointConfig.memory_every=1 instead"
            )
        self.holders: list[HolderRef] = [(str(n), str(i)) for n, i in spec.options["holders"]]
        self.copies = int(spec.options.get("copies", 2))
        self.namespace = str(spec.options.get("namespace", "forge_ckpt"))
        # (claim order, claim nonce, save attempt): every change a holder is asked for carries it
        # (`Holder._admit`); None: unfenced (a tool that reads)
        self.token = token_of(spec.options.get("fence"))

    def sub(self, prefix: str) -> MemoryStorage:
        return MemoryStorage(self.spec.child(prefix))

    def key(self, path: str) -> str:
        return join(self.prefix, path) if self.prefix else path.strip("/")

    # ---- holders ---------------------------------------------------------------------------
    # (the holder calls: `calls.HolderCalls`)
    def put_copies(
        self,
        path: str,
        data: Any,
        record: FileRecord,
        placed: Sequence[str] = (),
        exclusive: bool = False,
    ) -> list[str]:
        """Hand `data` to `copies` live holders (other nodes first), streamed to all of a
        batch at once; the node ids that ack. `placed`: nodes that already have it;
        `exclusive`: a holder with another file of that name refuses it."""
        key, rec = self.key(path), transport.record_dict(record, exclusive, self.token)
        me = current().node_id()
        order = [h for h in preference(key, self.holders, me) if h[1] not in placed]
        view = memoryview(data).cast("B")
        slow = _ViaRay(view)
        done: list[str] = list(placed)
        tried: list[str] = []
        while len(done) < self.copies and order:
            batch, order = order[: self.copies - len(done)], order[self.copies - len(done) :]
            futs = [(h, current().submit(self._place, h, key, view, rec, slow)) for h in batch]
            for h, fut in futs:
                problem = fut.result()
                if problem is None:
                    done.append(h[1])
                else:
                    tried.append(f"{h[1][:8]} ({problem})")
        slow.ref = None
        if len(done) < self.copies:
            raise StorageError(
                f"{self.where(path)}: only {len(done)} of {self.copies} copies could be placed "
                f"(holders tried: {tried or 'none left'}); CheckpointConfig.memory_copies"
            )
        if me in done:
            log.warning("%s: a copy is on the writer's own node (too few other nodes)", key)
        return done

    def _place(
        self, h: HolderRef, key: str, view: memoryview, rec: dict[str, Any], slow: _ViaRay
    ) -> str | None:
        """One copy: streamed, or through Ray when the holder lives but cannot be streamed
        to. None when placed, else why not; a holder's refusal (budget, checksum, another
        file of that name where `rec` says create-only) raises."""
        how, why = self.direct(h, lambda ep: transport.put(ep, key, view, rec))
        if how == "ok":
            return None
        if how == DEAD:
            return str(why)
        what = (key, slow.get(), rec)
        return self._await_put(h, self._put(h, what, refresh=False), what)

    def _put(self, h: HolderRef, what: tuple[str, Any, dict], refresh: bool) -> Any | None:
        """Start one holder's put of (key, object ref or the small file's bytes, record); None
        if there is no such holder (any more)."""
        key, ref, record = what
        try:
            return self.handle(h[0], refresh).put.remote(key, [ref], record)
        except ValueError:
            return None

    def _await_put(self, h: HolderRef, fut: Any | None, what: tuple[str, Any, dict]) -> str | None:
        """Wait for a put; once more with a fresh handle if this process's cached one is of
        a holder that was replaced. None when the copy is placed, else why not."""
        problem = "no holder"
        for retry in (False, True):
            if retry:
                fut = self._put(h, what, refresh=True)
            if fut is None:
                continue
            try:
                current().get(fut, timeout=CALL_TIMEOUT_S)
                return None
            except _DEAD as e:
                problem = type(e).__name__
            except ray.exceptions.RayTaskError as e:
                raise _unwrap(e) from None
        return problem

    # ---- writing ---------------------------------------------------------------------------
    def writer(self, path: str, exclusive: bool = False) -> Writer:
        """`exclusive`: a holder keeping another file of this name refuses it (a stale job
        shares its successor's holders: its late write must not replace a committed file)."""
        from .writer import MemWriter

        return MemWriter(self, path, exclusive)

    def publish(self, path: str, data: bytes) -> FileRecord:
        self._everywhere(path, data, overwrite=True)
        c = Checksums(self.digest)
        c.update(memoryview(data).cast("B"))
        return c.record(path)

    def _everywhere(self, path: str, data: bytes, overwrite: bool) -> list[bool]:
        done = self.fenced("create", self.key(path), bytes(data), overwrite)
        if not done:
            raise StorageError(f"{self.where(path)}: no memory holder is alive")
        return [ok for _, ok in done]

    def create(self, path: str, data: bytes) -> str:
        # One round trip: a holder that has the file keeps it and says so. (Holders disagree
        # only after a crash mid-create, and a step with any marker is never saved again.)
        if not all(self._everywhere(path, data, overwrite=False)):
            raise AlreadyExistsError(f"{self.where(path)} already exists")
        return crc32c_of_bytes(data)

    def replace(self, path: str, data: bytes, tag: str) -> str:
        done = self.fenced("replace", self.key(path), bytes(data), tag)
        if not done or any(t is None for _, t in done):
            raise PreconditionFailedError(f"{self.where(path)} changed or vanished")
        return crc32c_of_bytes(data)

    def read_tagged(self, path: str) -> tuple[bytes, str] | None:
        try:
            data = bytes(self.read(path))
        except FileNotFoundError:
            return None
        return data, crc32c_of_bytes(data)

    # ---- reading ---------------------------------------------------------------------------
    def read(self, path: str, start: int = 0, end: int | None = None) -> bytearray:
        """From a holder on this node if one has the file; a large read from other nodes is
        split over every holder that has it, in parallel, each part streamed into its place
        in one buffer. One round trip for a small file: a holder answers a large range with
        its size instead of the bytes."""
        return self._read(self.key(path), start, end, None)

    def read_verified(self, path: str, expected: FileRecord | None = None) -> bytearray:
        """The whole file, checksummed as it arrives when it comes in one stream."""
        sums = None if expected is None else Checksums(expected_algo(expected))
        try:
            buf = self._read(self.key(path), 0, None, sums)
        except FileNotFoundError:
            raise CheckpointCorruptError(self.where(path), "file is missing") from None
        if expected is not None:
            assert sums is not None
            try:
                if sums.size != len(buf):  # spread over holders, or via Ray: not checked yet
                    self._check(path, buf, expected)
                else:
                    check_record(self.where(path), sums.size, sums.crc, expected,
                                 sums.record(path))  # fmt: skip
            except CheckpointCorruptError as e:
                return self._one_good_copy(path, expected, e)
        return buf

    def _check(self, path: str, data: Any, expected: FileRecord) -> None:
        """`data` is the file `expected` records, or CheckpointCorruptError."""
        sums = Checksums(expected_algo(expected))
        sums.update(memoryview(data).cast("B"))
        check_record(self.where(path), sums.size, sums.crc, expected, sums.record(path))

    def _one_good_copy(
        self, path: str, expected: FileRecord, first: CheckpointCorruptError
    ) -> bytearray:
        """A holder's copy that matches `expected`, each read whole from one holder: a
        stale job's late write that reached holders without a copy of the name (its writer
        on another node placed it elsewhere) left some copies that are not the committed
        file (review 21). Raises `first` (the first read's error) when none matches."""
        key = self.key(path)
        for ref, sizes in self.on_all("sizes", key):
            if sizes.get(key) != expected.size:
                continue
            data = self._get(ref, key, 0, None, None, None)
            if data is _GONE or data is None or isinstance(data, int):
                continue
            try:
                self._check(path, data, expected)
            except CheckpointCorruptError:
                continue
            log.warning("%s: a holder's copy differs from the record; read another", key)
            return data if isinstance(data, bytearray) else bytearray(data)
        raise first

    def _read(self, key: str, start: int, end: int | None, sums: Checksums | None) -> bytearray:
        me = current().node_id()
        ranked = preference(key, self.holders, me)
        for ref in [r for r in ranked if r[1] == me] + [r for r in ranked if r[1] != me]:
            limit = None if ref[1] == me else 2 * READ_CHUNK
            data = self._get(ref, key, start, end, limit, sums)
            if data is _GONE:
                continue
            if isinstance(data, int):  # large, on another node
                try:
                    data = self._read_large(key, ref, start, min(end or data, data), sums)
                except _DEAD:
                    continue
            if data is not None:
                return data if isinstance(data, bytearray) else bytearray(data)
        raise FileNotFoundError(f"{self.where(key)}: no live memory holder has it")

    def _get(
        self, ref: HolderRef, key: str, start: int, end: int | None, limit: int | None,
        sums: Checksums | None,
    ) -> Any:  # fmt: skip
        """One holder's answer to a read (bytes, the file's size, or None); `_GONE` if the
        holder is dead."""
        how, got = self.direct(ref, lambda ep: transport.get(ep, key, start, end, limit,
                                                              sums=sums))  # fmt: skip
        if how == "ok":
            return got
        if how == DEAD:
            return _GONE
        try:
            return self.call(ref, "get", key, start, end, limit, timeout=CALL_TIMEOUT_S)
        except _DEAD:
            return _GONE

    def _read_large(
        self, key: str, first: HolderRef, start: int, stop: int, sums: Checksums | None
    ) -> Any:
        """Parts from every holder that has the file, or all from `first` if it is the only
        one (or a holder fails mid-read)."""
        holding = [ref for ref, sizes in self.on_all("sizes", key) if key in sizes]
        if len(holding) > 1:
            try:
                return self._read_spread(key, holding, start, stop)
            except (*_DEAD, _LostMidRead):
                pass
        data = self._get(first, key, start, stop, None, sums)
        if data is _GONE:
            raise ray.exceptions.RayActorError()
        return data

    def _read_spread(
        self, key: str, holding: builtins.list[HolderRef], start: int, stop: int
    ) -> bytearray:
        """One part per holder, each streamed into its place in one buffer, at once."""
        out = bytearray(stop - start)
        view = memoryview(out)
        n = min(len(holding), max(1, (stop - start) // READ_CHUNK))
        cuts = [start + (stop - start) * i // n for i in range(n + 1)]

        def part(ref: HolderRef, a: int, b: int) -> None:
            into = view[a - start : b - start]
            how, got = self.direct(ref, lambda ep: transport.get(ep, key, a, b, into=into))
            if how != "ok":  # through Ray (or gone): that holder's part the old way
                got = self.call(ref, "get", key, a, b, timeout=CALL_TIMEOUT_S)
                if got is not None and len(got) == b - a:
                    into[:] = memoryview(got)
                    got = b - a
            if got != b - a:
                raise _LostMidRead(key)

        futs = [current().submit(part, ref, a, b)
                for ref, a, b in zip(holding, cuts, cuts[1:], strict=False)]  # fmt: skip
        for fut in futs:
            fut.result()
        return out

    def size(self, path: str) -> int | None:
        key = self.key(path)
        for _, sizes in self.on_all("sizes", key):
            if key in sizes:
                return int(sizes[key])
        return None

    def walk(self, prefix: str = "") -> builtins.list[tuple[str, int]]:
        base = self.key(prefix)
        found: dict[str, int] = {}
        for _, sizes in self.on_all("sizes", base):
            found.update(sizes)
        cut = len(self.prefix) + 1 if self.prefix else 0
        inside = base.rstrip("/") + "/" if base else ""
        return sorted((k[cut:], n) for k, n in found.items() if k.startswith(inside))

    def list(self, prefix: str = "") -> builtins.list[str]:
        depth = len([p for p in prefix.strip("/").split("/") if p])
        names = {p.split("/")[depth] for p, _ in self.walk(prefix)}
        return sorted(names)

    # ---- deleting --------------------------------------------------------------------------
    def delete(self, path: str) -> None:
        self.fenced("delete", self.key(path))

    def delete_prefix(self, prefix: str) -> None:
        self.fenced("delete_prefix", self.key(prefix))

    def rename(self, src: str, dst: str) -> None:
        """In every holder's heap: one round trip, where a copy would be three."""
        if not any(moved for _, moved in self.fenced("rename", self.key(src), self.key(dst))):
            raise FileNotFoundError(f"{self.where(src)}: no live memory holder has it")

    def move_prefix(self, src: str, dst: str, first: str | None = None) -> None:
        raise StorageError(f"{self.url}: the memory tier does not move steps (drop them)")


class _ViaRay:
    """The file as Ray's fallback sends it: put into the object store once, when a first
    holder needs it (a small file rides in the call itself)."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.lock = view, threading.Lock()
        self.ref: Any = None

    def get(self) -> Any:
        with self.lock:
            if self.ref is None:
                small = self.view.nbytes <= INLINE_MAX
                self.ref = self.view.tobytes() if small else current().put(np.asarray(self.view))
            return self.ref
