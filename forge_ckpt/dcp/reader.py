"""DCP's read, straight into the destination tensors: one pass per file, files in parallel.

DCP's `FileSystemReader` opens every tensor item with `torch.load` (a new tensor read from
the file) and copies it into the destination: two copies per byte, one thread. Here every
file is read once, in order, by a thread of its own: a tensor item whose destination is a
contiguous CPU tensor of the saved dtype and shape gets its bytes read (`preadv`) into the
destination's memory, the few hundred bytes of zip records around them into small buffers
(`tensor_blob` finds where the bytes lie without `torch.load`); other items (small ones,
non-tensor values, resharded slices, GPU destinations) are read into one buffer and copied
from a view of it. The file's CRC32C (and digest) is computed over the bytes as they arrive,
in file order, and checked when the file ends; a file of the wrong size is refused before
anything is read. Bytes already verified and held in memory (an object store's download)
are placed the same way, without checking them again.

Planner calls (`resolve_tensor`, `commit_tensor`, `load_bytes`) stay on the calling thread.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ..errors import CheckpointCorruptError
from ..storage import FileRecord
from ..storage.base import Checksums, check_record, expected_algo, fault
from . import tensor_blob

CHUNK = 8 * 1024 * 1024  # hashed while still in the CPU's cache
SMALL = 256 * 1024  # items up to this size are read whole: one read instead of three


FileIdentity = tuple[int, int, int, int, int]


def identity(st: os.stat_result) -> FileIdentity:
    """What changes when a file is replaced (inode) or written (size, mtime, ctime: ctime
    cannot be set back from user space): equal identities mean the same bytes."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class Source(Protocol):
    """The bytes of one file: `readinto` fills all of `mv` from `pos` or raises."""

    size: int

    def readinto(self, pos: int, mv: memoryview) -> None: ...

    def close(self) -> None: ...


class FileSource:
    """A local file, read with `preadv` (no file position shared between threads)."""

    def __init__(self, path: str) -> None:
        self.where = path
        fault("get")  # FORGE_CKPT_FAULT=get:EIO reaches this read as it reaches the storage's
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointCorruptError(path, "file is missing") from None
        self.size = os.fstat(self.fd).st_size

    def readinto(self, pos: int, mv: memoryview) -> None:
        done = 0
        while done < len(mv):
            n = os.preadv(self.fd, [mv[done:]], pos + done)
            if n <= 0:
                raise CheckpointCorruptError(self.where, f"file ended after {pos + done} bytes")
            done += n

    def close(self) -> None:
        os.close(self.fd)


class MemorySource:
    """Bytes already in memory (verified where they were read)."""

    def __init__(self, data: bytes | bytearray, where: str) -> None:
        self.mv, self.size, self.where = memoryview(data).cast("B"), len(data), where

    def readinto(self, pos: int, mv: memoryview) -> None:
        if pos + len(mv) > self.size:
            raise CheckpointCorruptError(self.where, f"file ended after {self.size} bytes")
        mv[:] = self.mv[pos : pos + len(mv)]

    def close(self) -> None:
        self.mv.release()


@dataclass
class Blob:
    """One stored item (`offset`, `length` in its file) and the requests it serves."""

    offset: int
    length: int
    transforms: tuple[str, ...]
    reqs: list[ReadItem] = field(default_factory=list)


@dataclass
class FileJob:
    """One file to read: its bytes (opened now, or `fetch`ed in the pool: a download), its
    record when they are to be verified as they are read, its items."""

    source: Source | None
    fetch: Callable[[], Source] | None
    record: FileRecord | None
    where: str
    blobs: list[Blob]

    def open(self) -> Source:
        if self.source is not None:
            return self.source
        assert self.fetch is not None  # one of the two is always given
        return self.fetch()


Untransform = Callable[[ReadItem, tuple[str, ...], io.BytesIO], bytes]


def read_plan(
    plan: LoadPlan,
    planner: LoadPlanner,
    storage_data: dict[Any, Any],
    jobs_for: Callable[[dict[str, list[Blob]]], list[FileJob]],
    untransform: Untransform,
    threads: int,
) -> None:
    """Execute a DCP load plan: resolve destinations here, read the files in `threads`
    threads, then commit tensors and hand byte items to the planner here."""
    per_file: dict[str, dict[int, Blob]] = {}
    for req in plan.items:
        info = storage_data[req.storage_index]
        blobs = per_file.setdefault(info.relative_path, {})
        blob = blobs.get(info.offset)
        if blob is None:
            desc = tuple(info.transform_descriptors or ())
            blob = blobs[info.offset] = Blob(info.offset, info.length, desc)
        blob.reqs.append(req)
    jobs = jobs_for({p: sorted(b.values(), key=lambda b: b.offset) for p, b in per_file.items()})
    targets = {
        id(r): planner.resolve_tensor(r).detach()
        for r in plan.items
        if r.type != LoadItemType.BYTE_IO
    }
    read_bytes: dict[int, bytes] = {}
    reader = _Reader(targets, read_bytes, untransform)
    try:
        with ThreadPoolExecutor(max(1, min(threads, len(jobs))), "forge-dcp-read") as pool:
            for f in [pool.submit(reader.file, job) for job in jobs]:
                f.result()
    finally:
        for job in jobs:
            if job.source is not None:
                job.source.close()
    for req in plan.items:
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(read_bytes[id(req)]))
        else:
            planner.commit_tensor(req, targets[id(req)])


def _chunks(pos: int, end: int, step: int = CHUNK) -> Iterator[tuple[int, int]]:
    while pos < end:
        yield pos, min(end, pos + step)
        pos += step


class _Reader:
    """Reads one file's items into their destinations (`file` runs in a pool thread)."""

    def __init__(
        self, targets: dict[int, torch.Tensor], out: dict[int, bytes], untransform: Untransform
    ) -> None:
        self.targets, self.out, self.untransform = targets, out, untransform

    def file(self, job: FileJob) -> None:
        src = job.open()
        try:
            sums = None if job.record is None else Checksums(expected_algo(job.record))
            pos = 0
            for blob in job.blobs:
                if blob.offset < pos or blob.offset + blob.length > src.size:
                    raise CheckpointCorruptError(
                        job.where, f"item [{blob.offset}, +{blob.length}) lies outside the file"
                    )
                if sums is not None:
                    self._hash_range(src, pos, blob.offset, sums)
                self._blob(src, blob, sums)
                pos = blob.offset + blob.length
            if sums is not None and job.record is not None:
                self._hash_range(src, pos, src.size, sums)
                check_record(job.where, sums.size, sums.crc, job.record, sums.record(job.where))
        finally:
            if job.source is None:
                src.close()  # a fetched source; opened ones are closed by read_plan

    @staticmethod
    def _hash_range(src: Source, start: int, end: int, sums: Checksums) -> None:
        """Bytes no item asked for still count towards the file's checksum."""
        if end <= start:
            return
        scratch = memoryview(bytearray(min(CHUNK, end - start)))
        for a, b in _chunks(start, end):
            src.readinto(a, scratch[: b - a])
            sums.update(scratch[: b - a])

    def _read(self, src: Source, start: int, end: int, sums: Checksums | None) -> memoryview:
        buf = memoryview(bytearray(end - start))
        src.readinto(start, buf)
        if sums is not None:
            sums.update(buf)
        return buf

    def _blob(self, src: Source, blob: Blob, sums: Checksums | None) -> None:
        direct = self._direct_target(blob)
        if direct is not None and blob.length > SMALL:
            if self._read_direct(src, blob, direct, sums):
                return
        data = self._read(src, blob.offset, blob.offset + blob.length, sums)
        self._place(data, blob)

    def _direct_target(self, blob: Blob) -> torch.Tensor | None:
        """The destination a tensor item can be read into, if there is exactly one."""
        if blob.transforms or len(blob.reqs) != 1:
            return None
        req = blob.reqs[0]
        if req.type == LoadItemType.BYTE_IO or any(req.storage_offsets):
            return None
        t = self.targets[id(req)]
        if t.device.type != "cpu" or not t.is_contiguous() or tuple(t.size()) != tuple(req.lengths):
            return None
        return t

    def _read_direct(
        self, src: Source, blob: Blob, dest: torch.Tensor, sums: Checksums | None
    ) -> bool:
        """Zip records into small buffers, the tensor's bytes into `dest`; False (nothing
        read into `dest`, nothing hashed) when the blob is not a plain tensor that fits."""
        start, length = blob.offset, blob.length
        tail_len = min(length, tensor_blob.TAIL)
        tail = memoryview(bytearray(tail_len))
        src.readinto(start + length - tail_len, tail)
        records = tensor_blob.central_directory(tail, length)
        data_rec = max(records.values(), key=lambda r: r.size, default=None) if records else None
        if records is None or data_rec is None:
            return False
        head = memoryview(bytearray(min(data_rec.header + 30, length)))
        src.readinto(start, head)
        first = tensor_blob.data_offset(head, data_rec)  # the local header holds name, extra
        if first is None or first > length:
            return False
        head = memoryview(bytearray(head) + bytearray(first - len(head)))
        src.readinto(start + data_rec.header + 30, head[data_rec.header + 30 :])
        parsed = tensor_blob.parse(head, records, length)
        if parsed is None or not _fits(parsed, dest):
            return False
        if sums is not None:
            sums.update(head)
        out = _bytes_of(dest)
        for a, b in _chunks(0, parsed.nbytes):
            src.readinto(start + parsed.data_start + a, out[a:b])
            if sums is not None:
                sums.update(out[a:b])
        if sums is not None:  # the records after the data, in file order
            data_end = parsed.data_start + parsed.nbytes
            self._hash_range(src, start + data_end, start + length - tail_len, sums)
            sums.update(tail[max(0, data_end - (length - tail_len)) :])
        return True

    def _place(self, data: memoryview, blob: Blob) -> None:
        """Items read into memory: byte items kept for the planner, tensors copied from a view
        of `data` (or from `torch.load` for a blob tensor_blob does not know)."""
        saved = None
        for req in blob.reqs:
            raw = data
            if blob.transforms:  # DCP's stream extensions: undone the way DCP undoes them
                raw = memoryview(
                    bytearray(self.untransform(req, blob.transforms, io.BytesIO(data)))
                )
            if req.type == LoadItemType.BYTE_IO:
                self.out[id(req)] = bytes(raw)
                continue
            if saved is None or blob.transforms:
                saved = _tensor_view(raw)
            part = narrow_tensor_by_index(saved, req.storage_offsets, req.lengths)
            target = self.targets[id(req)]
            if target.size() != part.size():
                raise AssertionError(
                    f"req {req.storage_index} mismatch sizes {target.size()} vs {part.size()}"
                )
            target.copy_(part)


def _fits(parsed: tensor_blob.TensorBlob, dest: torch.Tensor) -> bool:
    return (
        parsed.contiguous_whole()
        and parsed.dtype == dest.dtype
        and parsed.size == tuple(dest.size())
        and parsed.nbytes == dest.nbytes
    )


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The writable bytes of a contiguous CPU tensor (any dtype)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy().data)


def _tensor_view(data: memoryview) -> torch.Tensor:
    """The tensor a torch.save blob holds, as a view of `data` where the layout is known."""
    length = len(data)
    records = tensor_blob.central_directory(data[max(0, length - tensor_blob.TAIL) :], length)
    parsed = tensor_blob.parse(data, records, length) if records else None
    if parsed is None:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if parsed.nbytes == 0:
        return torch.empty(parsed.size, dtype=parsed.dtype)
    flat = torch.frombuffer(data, dtype=torch.uint8, count=parsed.nbytes, offset=parsed.data_start)
    return flat.view(parsed.dtype).as_strided(parsed.size, parsed.stride, parsed.storage_offset)
