"""The storage seam: the only way forge_ckpt touches checkpoint bytes.

Two implementations, chosen by the folder URL (`open_storage`): a local path or `file://`
(POSIX: fsync, rename, link) and `s3://bucket/prefix` (any S3-compatible endpoint: conditional
writes instead of rename and flock). Paths inside a storage are `str`, '/'-separated and
relative to its root, never `pathlib.Path` (which mangles `s3://`).

A `Storage` is a live object with open clients; what crosses process boundaries (to actors and
trainer ranks) is its `StorageSpec`: the URL plus options, picklable, with secrets hidden from
`repr` so they never reach logs or error messages.
"""

from __future__ import annotations

import builtins
import contextvars
import errno
import functools
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import crc32c as _crc32c

from ..errors import CheckpointCorruptError, CheckpointError

CHUNK = 64 * 1024 * 1024  # large sequential writes and reads; bounds a read buffer
_SECRET_KEYS = ("secret", "token", "password", "key_id")


class StorageError(CheckpointError, OSError):
    """The storage refused or failed an operation; the message names the URL, never secrets."""


class AlreadyExistsError(StorageError):
    """A create-if-absent found the object already there (another writer got there first)."""


# Why an exclusive data write found its file there: the folder was prepared empty by the save.
ANOTHER = (
    "another writer wrote this step's file (a job or an actor that had lost the folder's lease "
    "and still wrote, or a late write of an earlier attempt of this save); this save is not "
    "committed, nothing committed is touched; retry the save (its step is prepared afresh)"
)


class PreconditionFailedError(StorageError):
    """A replace-if-unchanged found a different version than the one read."""


# Called right before each request that deletes objects of a listing (set by the
# coordinator around its storage calls: it checks its lease, renewing it if not just renewed).
# A listing may take up to a call bound, then the delete another: the lease must still hold
# when the delete lands, and a writer that lost it meanwhile must not delete what its
# successor wrote since (a listing made after the take-over names the successor's files).
BEFORE_DELETE: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "forge_ckpt_before_delete", default=None
)


def before_delete() -> None:
    """The current fence for a delete request, if any (see BEFORE_DELETE)."""
    fence = BEFORE_DELETE.get()
    if fence is not None:
        fence()


DIGESTS = ("blake3", "sha256")


@dataclass(frozen=True)
class FileRecord:
    """What a component reports for each file it wrote: path relative to the step folder,
    size, CRC32C (always: fast, catches accidents) and optionally a cryptographic digest
    ("blake3:<hex>" or "sha256:<hex>": what a signed manifest vouches for)."""

    path: str
    size: int
    crc32c: str  # 8 lowercase hex digits
    digest: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "size": self.size, "crc32c": self.crc32c}
        if self.digest is not None:
            d["digest"] = self.digest
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FileRecord:
        digest = d.get("digest")
        return cls(
            str(d["path"]),
            int(d["size"]),
            str(d["crc32c"]),
            None if digest is None else str(digest),
        )


class Checksums:
    """CRC32C, plus a cryptographic digest when one is asked for, over the same bytes."""

    def __init__(self, digest: str | None = None) -> None:
        if digest is not None and digest not in DIGESTS:
            raise ValueError(f"digest must be one of {DIGESTS} or None, got {digest!r}")
        self.crc, self.size, self.algo = 0, 0, digest
        self._h: Any = None
        if digest == "blake3":
            from blake3 import blake3

            self._h = blake3(max_threads=blake3.AUTO)
        elif digest == "sha256":
            import hashlib

            self._h = hashlib.sha256()

    def update(self, data: Any) -> None:
        self.crc = _crc32c.crc32c(data, self.crc)
        self.size += memoryview(data).nbytes
        if self._h is not None:
            self._h.update(data)

    def record(self, path: str) -> FileRecord:
        digest = None if self._h is None else f"{self.algo}:{self._h.hexdigest()}"
        return FileRecord(path, self.size, f"{self.crc:08x}", digest)


def checksums_of(data: Any, digest: str | None) -> Checksums:
    c = Checksums(digest)
    c.update(memoryview(data).cast("B"))
    return c


@dataclass(frozen=True)
class StorageSpec:
    """A picklable description of a storage: what actors and trainer ranks open themselves."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        shown = {k: ("***" if _is_secret(k) else v) for k, v in sorted(self.options.items())}
        return f"StorageSpec({self.url!r}, {shown})"

    def child(self, prefix: str) -> StorageSpec:
        return StorageSpec(join(self.url, prefix), self.options)

    def __hash__(self) -> int:
        return hash((self.url, tuple(sorted((k, repr(v)) for k, v in self.options.items()))))


def _is_secret(key: str) -> bool:
    return any(s in key.lower() for s in _SECRET_KEYS)


def join(*parts: str) -> str:
    """Join path parts with '/', keeping a URL scheme intact."""
    out = parts[0].rstrip("/")
    for p in parts[1:]:
        p = p.strip("/")
        if p:
            out = f"{out}/{p}"
    return out


def crc32c_of_bytes(data: Any) -> str:
    return f"{_crc32c.crc32c(memoryview(data).cast('B')):08x}"


def check_record(
    where: str,
    size: int,
    crc: int | str,
    expected: FileRecord,
    got: FileRecord | None = None,
    *,
    source: str = "the manifest",
    hint: str | None = None,
) -> None:
    """Raise CheckpointCorruptError naming `where` when size, checksum or digest differ from
    the record `source` holds. `hint` replaces the default advice (meant for a stored file)."""
    crc_hex = crc if isinstance(crc, str) else f"{crc:08x}"
    problem = None
    if expected.digest is not None and got is not None and got.digest != expected.digest:
        problem = f"{expected.digest.split(':')[0]} digest differs from {source}'s (altered)"
    elif size != expected.size:
        problem = f"size is {size} bytes, {source} says {expected.size} (truncated or replaced)"
    elif crc_hex != expected.crc32c:
        problem = f"checksum mismatch: crc32c is {crc_hex}, {source} says {expected.crc32c}"
    if problem is not None:
        raise CheckpointCorruptError(where, problem, hint)


def fault(op: str, allow_skip: bool = True) -> bool:
    """Fail on request, for tests: `FORGE_CKPT_FAULT=write:ENOSPC` (or `fsync:EIO`, ...) makes
    every matching operation in this process raise that errno; `fsync:sleep=0.2` makes it slow;
    `fsync:skip` / `fsync_dir:skip` silently skip file / directory fsyncs (the power-loss tests
    prove they would catch that). Operations: open, write, fsync, fsync_dir, rename, put, get.
    Returns True when the operation must be skipped."""
    spec = os.environ.get("FORGE_CKPT_FAULT")
    if not spec:
        return False
    skip = False
    for want, code in _fault_items(spec):
        if want != op:
            continue
        if code.startswith("sleep="):
            time.sleep(float(code.removeprefix("sleep=")))
        elif code == "skip":
            skip = skip or allow_skip
        else:
            num = getattr(errno, code or "EIO")
            raise OSError(num, f"{os.strerror(num)} (injected by FORGE_CKPT_FAULT)")
    return skip


@functools.lru_cache(maxsize=8)
def _fault_items(spec: str) -> tuple[tuple[str, str], ...]:
    """FORGE_CKPT_FAULT split into (operation, code), parsed once per value (it is read at
    every storage operation)."""
    return tuple((want, code) for want, _, code in (i.partition(":") for i in spec.split(",")))


def expected_algo(rec: FileRecord) -> str | None:
    """The digest algorithm a record was written with (to recompute it on read)."""
    return None if rec.digest is None else rec.digest.split(":", 1)[0]


class Writer(ABC):
    """One object/file being written; bytes are checksummed as they pass (no read-back)."""

    path: str

    @abstractmethod
    def write(self, data: Any) -> None: ...

    def write_held(self, data: Any) -> None:
        """`write`, for bytes the caller keeps alive and unchanged until `close()` returns (a
        snapshot's tensors): a writer that sends them later may keep a view, not a copy."""
        self.write(data)

    def size_hint(self, nbytes: int) -> None:
        """The file will be `nbytes` long (a writer may allocate it, or start sending)."""
        return None

    @abstractmethod
    def close(self) -> FileRecord:
        """Make the object durable and return its record (path as given to `writer`)."""

    @abstractmethod
    def abort(self) -> None:
        """Drop what was written; never raises for an already-missing object."""

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()


class GatheredWrites:
    """Small writes gathered into few large ones before they reach a `Writer`: each write is
    a checksum update and a system call or a send, so a file made of many small pieces (an
    encoded state's header and small blobs, `torch.save`'s zip records) costs that thousands
    of times over. Writes of `small` bytes or more go straight through, after what was
    gathered; what was gathered is handed on every `batch` bytes and at `flush()`."""

    def __init__(self, w: Writer, small: int = 1 << 20, batch: int = 4 << 20) -> None:
        self.w, self.small, self.batch = w, small, batch
        self.buf, self.pos = bytearray(), 0  # pos: every byte written, gathered or not

    def write(self, data: Any, held: bool = False) -> int:
        """`held`: `data` stays alive and unchanged until the writer closes (write_held)."""
        view = memoryview(data).cast("B")  # bytes, whatever `data` is (ndarray += adds)
        if view.nbytes >= self.small:
            self.flush()
            (self.w.write_held if held else self.w.write)(data)
        else:
            self.buf += view
            if len(self.buf) >= self.batch:
                self.flush()
        self.pos += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        if self.buf:
            self.w.write(self.buf)
            self.buf = bytearray()


class Storage(ABC):
    """A folder of objects. Every method takes paths relative to the root."""

    spec: StorageSpec

    @property
    def digest(self) -> str | None:
        """The cryptographic digest every writer of this storage computes (None: CRC32C only)."""
        return self.spec.options.get("digest")

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def call_bound_s(self) -> float | None:
        """The longest one storage request can block, retries included, when the storage's
        settings bound it (S3: timeouts x tries, docs/storage.md); None when nothing does
        (a local disk blocks as long as the kernel does)."""
        return None

    def where(self, path: str = "") -> str:
        """The full URL of `path`, for messages."""
        return join(self.url, path) if path else self.url

    @abstractmethod
    def sub(self, prefix: str) -> Storage:
        """The same storage rooted at `prefix` (shares clients; cheap)."""

    # ---- writing ---------------------------------------------------------------------------
    @abstractmethod
    def writer(self, path: str, exclusive: bool = False) -> Writer:
        """A durable, checksummed write of `path`. `exclusive`: create only, AlreadyExistsError
        if another write made `path` first (a step's data files: a stale writer's late write
        must never replace or truncate its successor's file)."""

    def write(self, path: str, data: Any, exclusive: bool = False) -> FileRecord:
        """Write a whole object durably (not atomically visible on POSIX: use `publish`);
        `exclusive`: see `writer`."""
        with self.writer(path, exclusive) as w:
            w.write(data)
            return w.close()

    @abstractmethod
    def publish(self, path: str, data: bytes) -> FileRecord:
        """Replace `path` so that readers see the old or the whole new content, durably."""

    @abstractmethod
    def create(self, path: str, data: bytes) -> str:
        """Create `path` only if absent (atomic, durable); returns its version tag.
        Raises AlreadyExistsError if it exists."""

    @abstractmethod
    def replace(self, path: str, data: bytes, tag: str) -> str:
        """Replace `path` only if its version is still `tag`; returns the new tag.
        Raises PreconditionFailedError otherwise (also when it vanished)."""

    @abstractmethod
    def read_tagged(self, path: str) -> tuple[bytes, str] | None:
        """Content and version tag, or None if absent."""

    # ---- reading ---------------------------------------------------------------------------
    @abstractmethod
    def read(self, path: str, start: int = 0, end: int | None = None) -> bytearray:
        """Bytes [start, end) of an object (whole by default). FileNotFoundError if absent."""

    def read_verified(self, path: str, expected: FileRecord | None = None) -> bytearray:
        """The whole object, checked against `expected` (size and crc32c) when given."""
        try:
            buf = self.read(path)
        except FileNotFoundError:
            raise CheckpointCorruptError(self.where(path), "file is missing") from None
        if expected is not None:
            c = checksums_of(buf, expected_algo(expected))
            check_record(self.where(path), c.size, c.crc, expected, c.record(path))
        return buf

    def read_buffer(self, path: str, expected: FileRecord | None = None) -> memoryview:
        """`read_verified` as a writable buffer that decoded tensors and arrays may view
        (a storage may back it with memory cheaper to fill than a bytearray)."""
        return memoryview(self.read_verified(path, expected))

    def verify(self, path: str, expected: FileRecord) -> None:
        """Check an object against its record without keeping it in memory."""
        self.read_verified(path, expected)

    @abstractmethod
    def size(self, path: str) -> int | None:
        """Size in bytes, or None if absent."""

    def exists(self, path: str) -> bool:
        return self.size(path) is not None

    @abstractmethod
    def list(self, prefix: str = "") -> builtins.list[str]:
        """Names of the immediate children (objects and sub-folders) of `prefix`, sorted."""

    @abstractmethod
    def walk(self, prefix: str = "") -> builtins.list[tuple[str, int]]:
        """Every object under `prefix`: (path relative to the root, size), sorted."""

    # ---- deleting and moving ---------------------------------------------------------------
    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove one object, durably; a missing one is fine."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Remove everything under `prefix`."""

    def rename(self, src: str, dst: str) -> None:
        """Give one object another name (DCP's `.metadata.tmp` -> `.metadata`); a copy and a
        delete where the storage has no rename. Not atomic, not durable until `sync_dir`."""
        self.write(dst, self.read(src))
        self.delete(src)

    @abstractmethod
    def move_prefix(self, src: str, dst: str, first: str | None = None) -> None:
        """Move a folder (POSIX rename; on object stores copy, then delete the object `first`
        before the others, so that a reader never sees a half-deleted source as whole)."""

    def abort_uploads(self, prefix: str = "") -> int:
        """Abort unfinished uploads left by crashed writers; returns how many."""
        return 0

    def fence_step(self, step: int) -> None:
        """A save attempt prepares `step`: storage shared with writers the lease cannot stop
        (the memory tier's holders) refuses an older attempt's writes to it from now on."""
        return None  # a folder: the lease and create-only writes fence it

    # ---- folders (POSIX only; object stores have none) ------------------------------------
    def makedirs(self, prefix: str) -> None:
        """Create a folder and make its name durable."""
        return None  # object stores have nothing to do here

    def sync_dir(self, prefix: str = "") -> None:
        """Make the names in a folder durable (fsync of the directory)."""
        return None  # object stores have nothing to do here

    def local_path(self, path: str = "") -> str | None:
        """The OS path of `path` on a local storage, else None."""
        return None

    def close(self) -> None:
        """Release thread pools and clients."""
        return None  # object stores have nothing to do here
