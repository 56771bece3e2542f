"""Local (POSIX) storage: fsync of files and folders, atomic rename, create-exclusive by link.

Durability follows the strict POSIX model that the power-loss tests enforce: a file's data is
durable after its fsync, a name only after the fsync of the folder that holds it. So every
publish is temp file + fsync + rename + fsync(folder), every create-if-absent is temp file +
fsync + link (fails if the name exists) + fsync(folder).
"""

from __future__ import annotations

import builtins
import errno
import fcntl
import mmap
import os
import shutil
import uuid
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointCorruptError
from .base import (
    ANOTHER,
    CHUNK,
    AlreadyExistsError,
    Checksums,
    FileRecord,
    PreconditionFailedError,
    Storage,
    StorageSpec,
    Writer,
    check_record,
    crc32c_of_bytes,
    expected_algo,
    fault,
)

HASHED_CHUNK = 8 * 1024 * 1024  # a verified read hashes each piece while it is in cache
MAP_MIN = 4 * 1024 * 1024  # buffers from this size on are anonymous maps
MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+); Python's mmap module does not name it


def _fresh(n: int) -> bytearray | mmap.mmap:
    """Writable memory for `n` bytes that a read fills. A bytearray is zeroed by a memset
    before the read overwrites it; an anonymous map gets zeroed pages from the kernel as the
    read first touches them: 25-40% less CPU here. (Huge pages were tried twice: on this VM
    about half of the reads into them cost 2-6x more CPU, in compaction or host-side faults.)
    """
    if n < MAP_MIN:
        return bytearray(n)
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _populate(buf: Any, start: int, length: int) -> None:
    """Make the pages of `buf[start:start + length]` (an anonymous map about to be read into)
    in one call, not one fault per 4 KiB page inside the read: about 10% less CPU for the read
    of a fresh buffer here. Kernels before 5.14 refuse the advice: the read faults them in."""
    if isinstance(buf, mmap.mmap):
        try:
            buf.madvise(MADV_POPULATE_WRITE, start, length)
        except OSError:
            pass


def fsync_dir(path: str) -> None:
    """Make the directory entries in `path` durable (a file's fsync does not cover its name)."""
    if fault("fsync_dir"):
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fault("fsync", allow_skip=False)
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalWriter(Writer):
    """A file opened for writing that checksums bytes as they pass and fsyncs on close.

    Small writes (DCP's serializer writes in pieces of a few bytes) are coalesced into one
    buffer, so the file gets few large writes whatever the caller's pattern."""

    SMALL = 1 << 20
    BUFFER = 4 << 20

    def __init__(
        self, full: str, path: str, digest: str | None = None, exclusive: bool = False
    ) -> None:
        self.full, self.path = full, path
        self._sums = Checksums(digest)
        fault("open")
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
        try:
            self._fd = os.open(full, flags, 0o644)
        except FileExistsError:
            raise AlreadyExistsError(errno.EEXIST, f"{full} already exists: {ANOTHER}") from None
        st = os.fstat(self._fd)
        self._id = (st.st_dev, st.st_ino)  # the file this writer made, whatever its name is now
        self._buf = bytearray()

    def write(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        self._sums.update(mv)
        if len(mv) < self.SMALL:
            self._buf += mv
            if len(self._buf) >= self.BUFFER:
                self._flush()
            return
        self._flush()
        self._write_all(mv)

    def _flush(self) -> None:
        if self._buf:
            self._write_all(memoryview(self._buf))
            self._buf = bytearray()

    def _write_all(self, mv: memoryview) -> None:
        for start in range(0, len(mv), CHUNK):
            fault("write")
            view = mv[start : start + CHUNK]
            while len(view):
                n = os.write(self._fd, view)
                view = view[n:]

    def close(self) -> FileRecord:
        try:
            self._flush()
            if not fault("fsync"):
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1
        return self._sums.record(self.path)

    def abort(self) -> None:
        """Remove the partial file, if the name is still ours: a successor may have removed
        the folder and written its own file under this name since."""
        self._buf = bytearray()
        try:  # compared while our file is still open: its inode number cannot be reused
            now = os.stat(self.full)  # by a successor's file until it is closed (review 20)
            if (now.st_dev, now.st_ino) == self._id:
                os.unlink(self.full)
        except FileNotFoundError:
            pass
        finally:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class LocalStorage(Storage):
    def __init__(self, spec: StorageSpec) -> None:
        root = spec.url.removeprefix("file://")
        self.root = os.path.abspath(root)
        self.spec = StorageSpec(self.root, dict(spec.options))

    def sub(self, prefix: str) -> LocalStorage:
        return LocalStorage(self.spec.child(prefix))

    def _p(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    def local_path(self, path: str = "") -> str:
        return self._p(path)

    # ---- writing ---------------------------------------------------------------------------
    def writer(self, path: str, exclusive: bool = False) -> LocalWriter:
        return LocalWriter(self._p(path), path, self.digest, exclusive)

    def _write_temp(self, path: str, data: bytes) -> tuple[str, FileRecord]:
        tmp = f"{self._p(path)}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            with LocalWriter(tmp, path, self.digest) as w:
                w.write(data)
                return tmp, w.close()
        except BaseException:
            _unlink(tmp)
            raise

    def publish(self, path: str, data: bytes) -> FileRecord:
        tmp, rec = self._write_temp(path, data)
        try:
            fault("rename")
            os.replace(tmp, self._p(path))
        except BaseException:
            _unlink(tmp)
            raise
        fsync_dir(os.path.dirname(self._p(path)))
        return rec

    def create(self, path: str, data: bytes) -> str:
        tmp, rec = self._write_temp(path, data)
        try:
            fault("rename")
            os.link(tmp, self._p(path))
        except FileExistsError:
            raise AlreadyExistsError(
                errno.EEXIST, f"{self.where(path)} already exists (written by another writer)"
            ) from None
        finally:
            _unlink(tmp)
        fsync_dir(os.path.dirname(self._p(path)))
        return _tag(rec.size, rec.crc32c)

    def replace(self, path: str, data: bytes, tag: str) -> str:
        # POSIX has no compare-and-swap on a file: an flock on a side file makes
        # read-compare-rename atomic among writers that use it (all of ours do).
        fd = os.open(f"{self._p(path)}.mutex", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            current = self.read_tagged(path)
            if current is None or current[1] != tag:
                raise PreconditionFailedError(
                    errno.ESTALE, f"{self.where(path)} changed since it was read"
                )
            rec = self.publish(path, data)
            return _tag(rec.size, rec.crc32c)
        finally:
            os.close(fd)  # releases the flock

    def read_tagged(self, path: str) -> tuple[bytes, str] | None:
        try:
            with open(self._p(path), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        return data, _tag(len(data), crc32c_of_bytes(data))

    # ---- reading ---------------------------------------------------------------------------
    def read(self, path: str, start: int = 0, end: int | None = None) -> bytearray:
        return self._read(path, start, end, None, None, bytearray)

    def read_verified(self, path: str, expected: FileRecord | None = None) -> bytearray:
        """One pass: each piece is checksummed as soon as it is read (still in the CPU's
        cache), and a file of the wrong size is refused before any of it is read."""
        return self._verified(path, expected, bytearray)

    def read_buffer(self, path: str, expected: FileRecord | None = None) -> memoryview:
        """`read_verified` into an anonymous map (no memset before the read, see `_fresh`);
        what is decoded from it stays a view of it."""
        return memoryview(self._verified(path, expected, _fresh))

    def _verified(self, path: str, expected: FileRecord | None, alloc: Callable[[int], Any]) -> Any:
        try:
            if expected is None:
                return self._read(path, 0, None, None, None, alloc)
            sums = Checksums(expected_algo(expected))
            buf = self._read(path, 0, None, sums, expected, alloc)
        except FileNotFoundError:
            raise CheckpointCorruptError(self.where(path), "file is missing") from None
        check_record(self.where(path), sums.size, sums.crc, expected, sums.record(path))
        return buf

    def _read(
        self,
        path: str,
        start: int,
        end: int | None,
        sums: Checksums | None,
        expected: FileRecord | None,
        alloc: Callable[[int], Any],
    ) -> Any:
        fault("get")
        step = HASHED_CHUNK if sums is not None else CHUNK
        with open(self._p(path), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if expected is not None and size != expected.size:
                check_record(self.where(path), size, "", expected)  # raises
            end = size if end is None else min(end, size)
            buf = alloc(max(end - start, 0))
            mv = memoryview(buf)
            pos = 0
            f.seek(start)
            while pos < len(mv):
                _populate(buf, pos, step)
                n = f.readinto(mv[pos : pos + step])
                if not n:
                    raise CheckpointCorruptError(self.where(path), f"file ended after {pos} bytes")
                if sums is not None:
                    sums.update(mv[pos : pos + n])
                pos += n
        return buf

    def verify(self, path: str, expected: FileRecord) -> None:
        """Checksum through a memory map: no copy into Python buffers (4-5x faster warm)."""
        full = self._p(path)
        try:
            f = open(full, "rb", buffering=0)
        except FileNotFoundError:
            raise CheckpointCorruptError(full, "file is missing") from None
        sums = Checksums(expected_algo(expected))
        with f:
            size = os.fstat(f.fileno()).st_size
            if size:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    m.madvise(mmap.MADV_SEQUENTIAL)
                    with memoryview(m) as mv:
                        for pos in range(0, size, CHUNK):
                            sums.update(mv[pos : pos + CHUNK])
        check_record(full, size, sums.crc, expected, sums.record(path))

    def size(self, path: str) -> int | None:
        try:
            return os.stat(self._p(path)).st_size
        except FileNotFoundError:
            return None

    def list(self, prefix: str = "") -> builtins.list[str]:
        try:
            return sorted(os.listdir(self._p(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def walk(self, prefix: str = "") -> builtins.list[tuple[str, int]]:
        out = []
        for dirpath, _, files in os.walk(self._p(prefix)):
            rel = os.path.relpath(dirpath, self.root)
            for name in files:
                p = name if rel == "." else f"{rel}/{name}"
                try:
                    out.append((p, os.stat(os.path.join(dirpath, name)).st_size))
                except FileNotFoundError:
                    continue
        return sorted(out)

    # ---- deleting and moving ---------------------------------------------------------------
    def delete(self, path: str) -> None:
        try:
            os.unlink(self._p(path))
        except FileNotFoundError:
            return
        fsync_dir(os.path.dirname(self._p(path)))

    def delete_prefix(self, prefix: str) -> None:
        full = self._p(prefix)
        shutil.rmtree(full, ignore_errors=True)
        if os.path.exists(full):
            shutil.rmtree(full)  # second try raises with the reason

    def rename(self, src: str, dst: str) -> None:
        os.replace(self._p(src), self._p(dst))

    def move_prefix(self, src: str, dst: str, first: str | None = None) -> None:
        os.makedirs(os.path.dirname(self._p(dst)), exist_ok=True)
        fault("rename")
        os.rename(self._p(src), self._p(dst))
        fsync_dir(os.path.dirname(self._p(src)))
        fsync_dir(os.path.dirname(self._p(dst)))

    def makedirs(self, prefix: str) -> None:
        full = self._p(prefix)
        missing = []
        while not os.path.isdir(full):
            missing.append(full)
            full = os.path.dirname(full)
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:  # another rank or actor made it meanwhile
                continue
            fsync_dir(os.path.dirname(d))

    def sync_dir(self, prefix: str = "") -> None:
        fsync_dir(self._p(prefix))


def _tag(size: int, crc: str) -> str:
    return f"{size}-{crc}"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
