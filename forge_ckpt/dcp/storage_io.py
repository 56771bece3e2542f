"""DCP's `StorageWriter` / `StorageReader` over forge_ckpt's storage seam.

The files stay standard DCP (`__<rank>_<k>.distcp` written by DCP's own serializer, a pickled
`.metadata`), so stock DCP and TorchTitan load a local step folder and DCP's fsspec reader an
S3 one. What changes is where the bytes go: DCP's `FileSystemWriter` writes through a
`FileSystemBase`, the same extension point DCP's fsspec writer uses, and ours sends each file
through `Storage.writer`: straight to the destination (a local file, or a parallel multipart
upload), checksummed as it passes, so no file is ever read back for its CRC32C. Each rank
records the files it wrote; those records are what it reports to the coordinator.

Reading: `.metadata` is checked against the manifest and then unpickled with an allowlist
(`dcp_metadata`), never with `pickle.load`; shards come from the storage (ranged parallel GETs
on S3) verified against their records as they are read, unless the bytes are the very ones
this rank verified while preparing (held in memory): DCP never reads a file that was checked
earlier and could have been replaced since.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import pickle
import threading
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..errors import CheckpointCorruptError
from ..storage import FileRecord, Storage
from ..storage.base import GatheredWrites, StorageError, check_record
from . import zip_crc
from .reader import (
    Blob,
    FileIdentity,
    FileJob,
    FileSource,
    MemorySource,
    Source,
    identity,
    read_plan,
)

METADATA = ".metadata"
_DCP_VERSION = getattr(dcp_filesystem, "CURRENT_DCP_VERSION", "1.0.0")  # what DCP's finish sets
MISFITS_SHOWN = 12  # a changed model can differ in hundreds of tensors: name the first ones


def alone(pg: dist.ProcessGroup | None) -> bool:
    """Whether a DCP call can skip its collectives: a trainer of one rank. Over a group of
    one, DCP still pickles its plans and results through gloo and back (a quarter of a small
    trainer's save); `no_dist` writes the same files without them. (DCP then warns once per
    process that it assumes a single process, which is true. That warning is not filtered:
    a filter would be process-wide, since DCP's wrapper is the frame it names, and would hide
    it from a job whose own save forgot `init_process_group` (review 37).)"""
    return not dist.is_initialized() or dist.get_world_size(pg) == 1


class _WriteStream(io.RawIOBase):
    """The file object DCP writes into: a storage writer behind `GatheredWrites`, counting
    for `tell()`. `torch.save` writes each item as a zip of many small records (a small
    trainer's save made about 3,000 writes per file); a tensor of 64 KiB or more goes
    straight through."""

    def __init__(self, writer: Any) -> None:
        self.out = GatheredWrites(writer, small=64 << 10, batch=1 << 20)

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self.out.write(b)

    def tell(self) -> int:
        return self.out.pos


class _NoCloseWriter(io.IOBase):
    """What DCP wraps each item's stream in (`close()` flushes, never closes), made once:
    DCP defines this class anew inside `transform_save_stream`, for every item it writes,
    a fifth of a small trainer's save (258 items, 20 of 68 ms) on this project's machines."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self.raw.write(b)

    def close(self) -> None:
        self.raw.flush()  # but not close: DCP appends the next item to the same stream


class _Transforms:
    """DCP's save-stream transforms (`FileSystemWriter.transforms`) without the class made
    per item when there are no stream extensions (the default); with extensions, DCP's own."""

    def __init__(self, dcp_transforms: Any) -> None:
        self._dcp = dcp_transforms
        self.extensions = dcp_transforms.extensions

    def transform_save_stream(self, write_item: WriteItem, raw_stream: Any) -> Any:
        if self.extensions:
            return self._dcp.transform_save_stream(write_item, raw_stream)
        return _NoCloseWriter(raw_stream), []


class SeamFileSystem(FileSystemBase):
    """DCP's file-system interface on a `Storage` rooted at the step folder."""

    def __init__(
        self,
        store: Storage,
        expected: dict[str, FileRecord] | None = None,
        cache: dict[str, bytes | bytearray] | None = None,
        seen: dict[str, FileIdentity] | None = None,
    ) -> None:
        self.store = store
        self.seen = seen or {}  # path -> identity of a local file verified before
        self.expected = expected or {}  # path -> record: verified on read
        self.cache = cache if cache is not None else {}  # path -> verified bytes
        self.records: dict[str, FileRecord] = {}
        self.write_errors: list[BaseException] = []  # of every writer thread (SeamWriter)
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        rel = str(path)
        if mode == "wb":
            try:
                # Our CRC32C covers every byte: torch.save's zip CRC32 is redundant work.
                with self.store.writer(rel, exclusive=True) as w, zip_crc.off():
                    stream = _WriteStream(w)
                    yield stream
                    stream.out.flush()  # what was gathered, before the writer closes
                    rec = w.close()
            except BaseException as e:
                with self._lock:
                    self.write_errors.append(e)
                raise
            with self._lock:
                self.records[rel] = rec
        elif mode == "rb":
            local = self.store.local_path(rel)
            if local is not None and rel not in self.cache and rel not in self.expected:
                with open(local, "rb") as f:  # an unverified load: DCP reads slices of the file
                    yield f
            else:
                yield io.BytesIO(self.read(rel))
        else:
            raise ValueError(f"unsupported mode {mode!r}")

    def read(self, rel: str) -> bytes | bytearray:
        data = self.cache.pop(rel, None)
        if data is None:
            data = self.store.read_verified(rel, self.expected.get(rel))
        return data

    def jobs(self, per_file: dict[str, list[Blob]]) -> list[FileJob]:
        """How `dcp_read` gets each file's bytes: held verified bytes as they are; a local file
        opened now (its size checked against its record before anything is read), verified
        as it is read; an object downloaded (ranged parallel GETs) and verified in the pool."""
        jobs: list[FileJob] = []
        try:
            for rel, blobs in per_file.items():
                where = self.store.where(rel)
                data = self.cache.pop(rel, None)
                local = self.store.local_path(rel)
                if data is not None:
                    jobs.append(FileJob(MemorySource(data, where), None, None, where, blobs))
                elif local is not None:
                    jobs.append(self._local_job(rel, local, blobs))
                else:
                    fetch = functools.partial(self._fetch, rel, where)
                    jobs.append(FileJob(None, fetch, None, where, blobs))
        except BaseException:
            for job in jobs:
                if job.source is not None:
                    job.source.close()
            raise
        return jobs

    def _local_job(self, rel: str, local: str, blobs: list[Blob]) -> FileJob:
        src, rec = FileSource(local), self.expected.get(rel)
        if rec is not None and src.size != rec.size:
            src.close()
            check_record(local, src.size, "", rec)  # raises: truncated or replaced
        if rec is not None and self.seen.get(rel) == identity(os.fstat(src.fd)):
            rec = None  # the very file verified before this load: not checked twice
        return FileJob(src, None, rec, local, blobs)

    def _fetch(self, rel: str, where: str) -> Source:
        return MemorySource(self.read(rel), where)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return f"{path}/{suffix}" if str(path) else suffix

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        # DCP renames `.metadata.tmp` to `.metadata`; the COMMIT marker, not this rename, is
        # what makes a step visible, so a copy is as good as a rename here (S3 has none).
        src, dst = str(path), str(new_path)
        self.store.rename(src, dst)
        with self._lock:
            rec = self.records.pop(src)
            self.records[dst] = dataclasses.replace(rec, path=dst)

    def init_path(self, path: str | os.PathLike) -> str:
        return str(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        return None  # the coordinator created the step folder

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never picked by DCP on its own

    def exists(self, path: str | os.PathLike) -> bool:
        return self.store.exists(str(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        self.store.delete(str(path))

    def ls(self, path: str | os.PathLike) -> list[str]:
        return self.store.list(str(path))


class SeamWriter(FileSystemWriter):
    """Standard DCP files written through the seam by `thread_count` threads per rank."""

    def __init__(self, store: Storage, thread_count: int = 2) -> None:
        # sync_files=False: our storage writer makes each file durable itself (DCP would
        # otherwise fall back to a machine-wide os.sync() for a stream without a fileno).
        super().__init__("", sync_files=False, thread_count=thread_count)
        self.transforms = _Transforms(self.transforms)  # type: ignore[assignment]  # duck-typed
        self.seam = SeamFileSystem(store)
        # DCP types `fs` as its local FileSystem but only uses the FileSystemBase interface.
        self.fs = self.seam  # type: ignore[assignment]
        self.path = ""

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(None)  # the folder is ours, never DCP's checkpoint_id

    def write_data(
        self, plan: SavePlan, planner: dcp_planner.SavePlanner
    ) -> Future[list[WriteResult]]:
        """DCP's write, failing when any file failed. DCP writes files in `thread_count - 1`
        helper threads beside the caller's and only prints a helper's error: the save went
        on without that file, and a step whose `.metadata` lacks some items committed (a
        stale rank's late file met by the create-only write, a full disk: review 20)."""
        with self.seam._lock:
            self.seam.write_errors.clear()
        fut = super().write_data(plan, planner)
        written = {r.index for r in fut.wait()}
        if self.seam.write_errors:
            raise self.seam.write_errors[0]
        missing = [item.index.fqn for item in plan.items if item.index not in written]
        if missing:
            raise StorageError(
                f"{self.seam.store.where('')}: DCP wrote no data for {len(missing)} item(s) "
                f"({', '.join(missing[:MISFITS_SHOWN])}): a writer thread failed"
            )
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's finish, with `.metadata` created in one create-only write. DCP writes a
        temp file, deletes any `.metadata` there and renames: a stale rank (its job lost the
        lease while it wrote) whose finish ran late would delete and replace the `.metadata`
        of its successor's committed step of that number. Created only if absent, the
        second of the two fails (the successor's save at worst, once, before its commit)."""
        metadata.version = _DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        metadata.storage_meta = self.storage_meta()
        per_rank = not self.use_collectives and self.rank is not None  # as DCP names it
        with self.seam.create_stream(
            f"__{self.rank}{METADATA}" if per_rank else METADATA, "wb"
        ) as f:
            pickle.dump(metadata, f)

    @property
    def records(self) -> list[FileRecord]:
        return sorted(self.seam.records.values(), key=lambda r: r.path)


_SCALARS = (bool, int, float, str, type(None))
_saved_bytes: dict[tuple[str, ...], bytes] = {}  # (type, repr, zip CRC32) -> torch.save output
_SAVED_MAX = 4096


def _scalar_key(obj: Any) -> tuple[str, str] | None:
    """A key for a small immutable value (repr tells -0.0 from 0.0 and 1 from True)."""
    if isinstance(obj, _SCALARS) or (
        isinstance(obj, tuple) and len(obj) <= 8 and all(isinstance(x, _SCALARS) for x in obj)
    ):
        return type(obj).__name__, repr(obj)
    return None


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner, but the `torch.save` bytes of a small immutable value are made
    once per process: TorchTitan flattens every field of every optimizer param group into its
    own item (hundreds of `False`, `0.9`, `1e-08` per save, a few distinct values), and
    serializing each again was a third of a small trainer's save. Same bytes, same files."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        scalar = _scalar_key(object) if write_item.type == WriteItemType.BYTE_IO else None
        if scalar is None:
            return super().transform_object(write_item, object)
        # The bytes hold torch.save's zip CRC32 or not, as this thread's setting says
        # (zip_crc.off): kept apart, no save gets the other kind (review 33).
        key = (*scalar, str(torch.serialization.get_crc32_options()))
        data = _saved_bytes.get(key)
        if data is None:
            buf = io.BytesIO()
            torch.save(object, buf)
            data = buf.getvalue()
            if len(_saved_bytes) >= _SAVED_MAX:
                _saved_bytes.clear()
            _saved_bytes[key] = data
        return io.BytesIO(data)


class SeamReader(FileSystemReader):
    """DCP's reader over the seam: items read straight into their destinations (`dcp_read`),
    `read_threads` files at a time, verified as read; metadata without `pickle.load`."""

    def __init__(
        self,
        store: Storage,
        expected: dict[str, FileRecord],
        cache: dict[str, bytes | bytearray] | None = None,
        read_threads: int = 4,
        seen: dict[str, FileIdentity] | None = None,
    ) -> None:
        super().__init__("")
        self.seam = SeamFileSystem(store, expected, cache, seen)
        self.fs = self.seam  # type: ignore[assignment]  # as in SeamWriter
        self.path = ""
        self.read_threads = read_threads

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        read_plan(
            plan, planner, self.storage_data, self.seam.jobs, self._untransform, self.read_threads
        )
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _untransform(self, req: ReadItem, descriptors: tuple[str, ...], raw: io.BytesIO) -> bytes:
        return self.transforms.transform_load_stream(req, descriptors, raw).read(-1)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(None)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from .metadata import load_metadata

        if kwargs.get("rank") is not None:
            raise CheckpointCorruptError(
                self.seam.store.where(METADATA), "per-rank metadata is not used"
            )
        data = self.seam.read(METADATA)
        metadata = load_metadata(data, self.seam.store.where(METADATA))
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


def verify_local(store: Storage, rel: str, rec: FileRecord) -> FileIdentity | None:
    """Verify a local file against its record; its identity when it provably did not change
    while it was read (a later read of the same identity needs no second check), else None."""
    path = store.local_path(rel)
    before = identity(os.stat(path)) if path is not None and os.path.exists(path) else None
    store.verify(rel, rec)
    after = identity(os.stat(path)) if path is not None else None
    return before if before is not None and before == after else None


def misfits(state_dict: dict[str, Any], metadata: Metadata) -> list[str]:
    """Why `dcp.load(state_dict)` from a checkpoint with `metadata` would fail or change what a
    tensor is: a key the checkpoint lacks, another shape, dtype or kind (tensor or not). DCP
    finds these only while loading, after other components may have been applied; the trainer
    checks them while preparing. `state_dict` is what DCP loads into, Stateful values resolved
    (keys flattened as DCP's default planner flattens them)."""
    flat, _ = flatten_state_dict(state_dict)
    saved = metadata.state_dict_metadata
    out = []
    for fqn, obj in flat.items():
        md = saved.get(fqn)
        is_tensor = isinstance(obj, torch.Tensor)
        if md is None:
            out.append(f"{fqn}: not in the checkpoint")
        elif not isinstance(md, TensorStorageMetadata):
            if is_tensor:
                out.append(f"{fqn}: the checkpoint holds a non-tensor value, this job a tensor")
        elif not is_tensor:
            out.append(f"{fqn}: the checkpoint holds a tensor, this job a {type(obj).__name__}")
        elif tuple(md.size) != tuple(obj.size()):
            out.append(f"{fqn}: shape {list(md.size)} in the checkpoint, {list(obj.size())} now")
        elif md.properties.dtype != obj.dtype:
            out.append(f"{fqn}: dtype {md.properties.dtype} in the checkpoint, {obj.dtype} now")
    if len(out) > MISFITS_SHOWN:
        out = [*out[:MISFITS_SHOWN], f"... and {len(out) - MISFITS_SHOWN} more"]
    return out
