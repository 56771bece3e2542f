"""The methods the storage part times, each a save (or write) followed by a cold load (or read)
of the same state: forge_ckpt's DCP writer/reader and actor files over the storage seam, raw
S3 transfers with forge_ckpt's own boto3 client, DCP's fsspec writer/reader, DCP's
`FileSystemWriter`/`FileSystemReader` (what TorchTitan's `dcp_save`/`dcp_load` use), and raw
local write + fsync / cold read. Every function returns seconds and bytes; none keeps state."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from forge_ckpt import serialization
from forge_ckpt.dcp.storage_io import SeamReader, SeamWriter
from forge_ckpt.storage import FileRecord, Storage

from .. import disk
from .s3_clients import _ranges, boto3_get

MiB = disk.MiB


@dataclass
class State:
    """What one step saves: a trainer state dict of float32 tensors and a few actor states."""

    trainer: dict[str, torch.Tensor]
    actors: list[dict[str, Any]]
    trainer_bytes: int = 0
    actor_bytes: int = 0
    records: list[FileRecord] = field(default_factory=list)  # of the last forge_ckpt save


def make_state(total: int, trainer_share: float, actor_files: int, seed: int = 0) -> State:
    """Random (incompressible) float32 data: MLP-like layers of <= 16 MiB weights plus a bias
    each for the trainer, 32 MiB numpy columns and small metadata for each actor."""
    rng = np.random.default_rng(seed)
    trainer_total = int(total * trainer_share)
    trainer: dict[str, torch.Tensor] = {}
    left, i = trainer_total, 0
    while left >= 4 * 1024:
        rows = min(left, 16 * MiB) // (4 * 1024)
        trainer[f"layers.{i}.weight"] = torch.from_numpy(rng.random((rows, 1024), np.float32))
        trainer[f"layers.{i}.bias"] = torch.from_numpy(rng.random(1024, np.float32))
        left -= rows * 4 * 1024
        i += 1
    actors = []
    each = (total - trainer_total) // actor_files
    for a in range(actor_files):
        cols, left = [], each
        while left >= 4:
            n = min(left, 32 * MiB) // 4
            cols.append(rng.random(n, np.float32))
            left -= n * 4
        meta = {"inserted": each // 4, "version": a, "returns": [float(x) for x in range(100)]}
        actors.append({"meta": meta, "columns": cols})
    tb = sum(t.nbytes for t in trainer.values())
    ab = sum(c.nbytes for s in actors for c in s["columns"])
    return State(trainer, actors, tb, ab)


def empty_like(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A same-shaped state dict to load into (allocated, and touched, before any timing)."""
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def _since(start: float) -> float:
    return time.perf_counter() - start


def _cpu_since(start: float) -> float:
    """CPU seconds of this process (every thread, user + system) since `start`."""
    return time.process_time() - start


# ---- forge_ckpt over the seam (local folder or S3) ------------------------------------------


def forge_save(store: Storage, state: State) -> dict[str, Any]:
    """`dcp.save` through SeamWriter and every actor's snapshot file at once, one thread
    each (in a job the trainer and the actors are processes that write in parallel), then
    the folder's fsync (local; nothing on S3). Records are kept on `state` for the load."""
    cpu = time.process_time()
    start = time.perf_counter()
    writer = SeamWriter(store)

    def trainer() -> float:
        dcp.save(state.trainer, storage_writer=writer, no_dist=True)
        return _since(start)

    def actor(i: int) -> FileRecord:
        snap = serialization.snapshot(state.actors[i], name=f"actor{i}", copy=False)
        return snap.write_to(store, f"actor-{i}.bin")

    with ThreadPoolExecutor(1 + len(state.actors)) as pool:
        dcp_done = pool.submit(trainer)
        actor_files = [pool.submit(actor, i) for i in range(len(state.actors))]
        dcp_s = dcp_done.result()
        records = [*writer.records, *(f.result() for f in actor_files)]
    store.sync_dir("")
    total_s = _since(start)
    cpu_s = _cpu_since(cpu)
    state.records = records
    dcp_bytes = sum(r.size for r in writer.records)
    return {
        "save_s": total_s,
        "save_cpu_s": cpu_s,
        "dcp_in_step_save_s": dcp_s,  # beside the actor files (the DCP rows: alone)
        "bytes": sum(r.size for r in records),
        "dcp_bytes": dcp_bytes,
        "files": len(records),
    }


def forge_load(store: Storage, state: State, target: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`dcp.load` through SeamReader (every file verified against its record) into `target`,
    and every actor file with `serialization.load_from` (verified, zero-copy decode), at once,
    one thread each, as a job's trainer and actor processes load in parallel."""
    expected = {r.path: r for r in state.records}
    cpu = time.process_time()
    start = time.perf_counter()

    def trainer() -> float:
        dcp.load(target, storage_reader=SeamReader(store, expected, cache={}), no_dist=True)
        return _since(start)

    def actor(i: int) -> None:
        serialization.load_from(store, f"actor-{i}.bin", expected[f"actor-{i}.bin"])

    with ThreadPoolExecutor(1 + len(state.actors)) as pool:
        dcp_done = pool.submit(trainer)
        actor_files = [pool.submit(actor, i) for i in range(len(state.actors))]
        dcp_s = dcp_done.result()
        for f in actor_files:
            f.result()
    total_s = _since(start)
    return {"load_s": total_s, "load_cpu_s": _cpu_since(cpu), "dcp_in_step_load_s": dcp_s}


def forge_dcp_alone(
    store: Storage, state: State, target: dict[str, torch.Tensor], evict: Callable[[], None]
) -> dict[str, Any]:
    """forge_ckpt's DCP layer alone: the trainer state through SeamWriter (then the folder's
    fsync), evicted, then read back through SeamReader (verified), with nothing beside it, as
    the stock DCP writers and readers are measured: the rows that compare the two layers."""
    writer = SeamWriter(store)
    start = time.perf_counter()
    dcp.save(state.trainer, storage_writer=writer, no_dist=True)
    store.sync_dir("")
    save_s = _since(start)
    expected = {r.path: r for r in writer.records}
    evict()
    start = time.perf_counter()
    dcp.load(target, storage_reader=SeamReader(store, expected, cache={}), no_dist=True)
    load_s = _since(start)
    return {"dcp_save_s": save_s, "dcp_load_s": load_s,
            "dcp_bytes": sum(r.size for r in writer.records)}  # fmt: skip


def check_loaded(state: State, target: dict[str, torch.Tensor]) -> None:
    """The loaded trainer state equals the saved one (run once, outside any timing)."""
    for k, v in state.trainer.items():
        if not torch.equal(v, target[k]):
            raise AssertionError(f"{k}: loaded tensor differs from the saved one")


# ---- raw S3 with forge_ckpt's boto3 client -----------------------------------------------------


def raw_put(s3: Any, bucket: str, key: str, nbytes: int, part: int, inflight: int) -> float:
    """A multipart PUT of `nbytes` (parts cut from one random buffer, copied per part as
    forge_ckpt's writer does), `inflight` parts at a time; returns seconds."""
    chunk = np.random.default_rng(1).integers(0, 255, part, dtype=np.uint8)
    start = time.perf_counter()
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

    def one(n: int, a: int, b: int) -> dict[str, Any]:
        body = chunk[: b - a].tobytes()
        r = s3.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=n, Body=body)
        return {"PartNumber": n, "ETag": r["ETag"]}

    with ThreadPoolExecutor(inflight) as pool:
        futures = [pool.submit(one, n, a, b) for n, (a, b) in enumerate(_ranges(nbytes, part), 1)]
        parts = [f.result() for f in futures]
    s3.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
    )
    return _since(start)


def raw_get(s3: Any, key: str, nbytes: int, part: int, inflight: int) -> float:
    """Parallel ranged GETs of the whole object into one preallocated buffer; returns seconds."""
    start = time.perf_counter()
    got = boto3_get(s3, key, nbytes, part, inflight)
    seconds = _since(start)
    if len(got) != nbytes:
        raise AssertionError(f"raw GET returned {len(got)} bytes, expected {nbytes}")
    return seconds


# ---- stock DCP writers and readers --------------------------------------------------------------


def fsspec_save(url: str, sd: dict[str, torch.Tensor], opts: dict[str, Any]) -> float:
    """DCP's `FsspecWriter` (s3fs), its defaults but `sync_files=False` (with True, DCP calls a
    machine-wide os.sync() for every s3fs stream, which has no fileno)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    start = time.perf_counter()
    dcp.save(sd, storage_writer=FsspecWriter(url, sync_files=False, **opts), no_dist=True)
    return _since(start)


def fsspec_load(url: str, target: dict[str, torch.Tensor], opts: dict[str, Any]) -> float:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    start = time.perf_counter()
    dcp.load(target, storage_reader=FsspecReader(url, **opts), no_dist=True)
    return _since(start)


def dcp_fs_save(path: str, sd: dict[str, torch.Tensor]) -> tuple[float, float]:
    """DCP's `FileSystemWriter` with its defaults (fsync per file, one thread): what
    TorchTitan's `dcp_save(state, checkpoint_id=path)` builds. Seconds, CPU seconds."""
    from torch.distributed.checkpoint import FileSystemWriter

    cpu = time.process_time()
    start = time.perf_counter()
    dcp.save(sd, storage_writer=FileSystemWriter(path), no_dist=True)
    return _since(start), _cpu_since(cpu)


def dcp_fs_load(path: str, target: dict[str, torch.Tensor]) -> tuple[float, float]:
    from torch.distributed.checkpoint import FileSystemReader

    cpu = time.process_time()
    start = time.perf_counter()
    dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)
    return _since(start), _cpu_since(cpu)


def raw_local(path: str, nbytes: int, cache: str) -> dict[str, float]:
    """Raw write + fsync of `nbytes` into one file, then its cold read (benchmarks.disk), into
    one reused buffer and into new memory."""
    write_s, write_cpu = disk.python_write_cpu(path, nbytes)
    read_s, read_cpu = disk.cold_read_cpu(path, cache)
    fresh_s, fresh_cpu = disk.cold_read_fresh_cpu(path, cache)
    disk.remove(path)
    return {
        "write_s": write_s,
        "write_cpu_s": write_cpu,
        "read_s": read_s,
        "read_cpu_s": read_cpu,
        "read_fresh_s": fresh_s,
        "read_fresh_cpu_s": fresh_cpu,
        "bytes": nbytes,
    }


def folder_bytes(path: str) -> int:
    return disk.tree_bytes(path) if os.path.exists(path) else 0
