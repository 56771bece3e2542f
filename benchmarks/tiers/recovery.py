"""Part "recovery" of `python -m benchmarks.tiers`: how fast a job is back after losing a node.

A job-like setup on node_a: a `Checkpointable` actor holding the state under test and a small
one. One save goes to both tiers (`memory_every=1`, `durable_every=1`: the step is committed in
memory, then persisted to the S3 folder; `wait()` for both). Then node_a is removed
(`cluster.remove_node(allow_graceful=False)`: raylet, object store and workers killed) and the
clock runs until `load()` has restored both actors, recreated on node_b:

- memory: the same coordinator loads; the copies on the head and node_b survive, so `load()`
  takes the memory step (`LoadResult.tier == "memory"`);
- durable: before the removal, the memory coordinator is closed and its holders shut down, and
  a coordinator with `memory_every=0` on the same S3 folder takes over, so the same step loads
  from S3 (its data folder evicted from the page cache first).

Split: removal (`remove_node` returns), recreate (new actors answer), load. node_a is re-added
between measurements; each measurement uses its own S3 prefix and its own holders.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from typing import Any

import ray

from forge_ckpt import CheckpointConfig, CheckpointCoordinator
from forge_ckpt.storage import open_storage

from .. import disk
from .actors import SmallState, TensorState
from .env import Env, spawn
from .stats import VerifyError, check, paired, spread

log = logging.getLogger("benchmarks")
VARIANTS = ("memory", "durable")
LOST, LIVE = "node_a", "node_b"


def _config(env: Env, folder: str, memory: bool, state_bytes: int) -> CheckpointConfig:
    extra: dict[str, Any] = {}
    if memory:
        budget = max(8 * 1024**3, 3 * state_bytes)
        extra = {"memory_every": 1, "durable_every": 1, "memory_copies": 2,
                 "memory_budget_bytes": budget}  # fmt: skip
    return CheckpointConfig(folder=folder, storage_options=env.s3_options(), **extra)


def _actors(node: str) -> tuple[Any, Any]:
    return spawn(TensorState, node), spawn(SmallState, node)


async def _save_step(coord: CheckpointCoordinator, actors: list, seed: int, size: int) -> list:
    """Fill the actors from `seed` and save them as step 1, in memory and in S3; returns the
    digests a load must restore."""
    big, small = actors
    want = await asyncio.gather(big.fill.remote(size, seed), small.advance.remote(seed))
    _register(coord, big, small)
    await coord.save(1)
    await coord.wait()  # the background persist of step 1 to S3
    mem = coord.tier.steps() if coord.tier is not None else None
    check("step 1 in memory and in S3", (mem, coord.steps()), ([1], [1]))
    return list(want)


def _register(coord: CheckpointCoordinator, big: Any, small: Any, replace: bool = False) -> None:
    coord.register("state", big, replace=replace)
    coord.register("small", small, replace=replace)


async def _durable_only(env: Env, coord: CheckpointCoordinator, folder: str, size: int) -> Any:
    """Hand the folder to a coordinator without the memory tier (holders gone)."""
    if coord.tier is not None:
        await asyncio.to_thread(coord.tier.shutdown)
    coord.close()
    return await _open(env, folder, False, size)


async def _open(env: Env, folder: str, memory: bool, size: int) -> CheckpointCoordinator:
    return await asyncio.to_thread(CheckpointCoordinator, _config(env, folder, memory, size))


async def recover_once(env: Env, variant: str, seed: int, state_bytes: int) -> dict[str, Any]:
    """Save, lose node_a, recreate the actors on node_b, load; times from the removal."""
    folder = env.s3_url(f"recovery/{variant}-{seed}")
    actors = list(_actors(LOST))
    coord: CheckpointCoordinator | None = None
    try:
        coord = await _open(env, folder, True, state_bytes)
        want = await _save_step(coord, actors, seed, state_bytes)
        if variant == "durable":
            coord = await _durable_only(env, coord, folder, state_bytes)
            _register(coord, *actors)
        await asyncio.to_thread(disk.drop_cache, [env.s3_data], env.cache)
        t0 = time.perf_counter()
        env.remove(LOST)  # in the main thread, as Ray's node handling wants
        t1 = time.perf_counter()
        big, small = _actors(LIVE)
        actors += [big, small]
        await asyncio.gather(big.ping.remote(), small.ping.remote())
        t2 = time.perf_counter()
        _register(coord, big, small, replace=True)
        loaded = await coord.load()
        t3 = time.perf_counter()
        if loaded is None:
            raise VerifyError(f"{variant}: load() found no step after the node loss")
        check(f"recovery ({variant}) tier", (loaded.step, loaded.tier), (1, variant))
        got = await asyncio.gather(big.digest.remote(), small.digest.remote())
        check(f"recovery ({variant}) state", list(got), want)
    finally:
        await _cleanup(env, coord, folder, actors)
    return {"total_s": t3 - t0, "remove_s": t1 - t0, "recreate_s": t2 - t1, "load_s": t3 - t2,
            "tier": loaded.tier, "verified": True}  # fmt: skip


async def _cleanup(
    env: Env, coord: CheckpointCoordinator | None, folder: str, actors: list
) -> None:
    """Holders and the lease released, the S3 prefix deleted, actors gone, node_a back."""
    if coord is not None:
        if coord.tier is not None:
            await asyncio.to_thread(coord.tier.shutdown)
        coord.close()
    store = open_storage(folder, env.s3_options())
    await asyncio.to_thread(store.delete_prefix, "")
    store.close()
    for actor in actors:  # those on the removed node are gone already: kill is a no-op
        ray.kill(actor)
    env.restore()  # add_node installs signal handlers: main thread only


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of each phase per variant; durable / memory as paired ratios."""
    out: dict[str, Any] = {
        v: {
            k: spread(r[v][k] for r in rows)
            for k in ("total_s", "remove_s", "recreate_s", "load_s")
        }
        for v in VARIANTS
    }
    out["ratios"] = {
        "durable_over_memory_total": paired(
            rows, lambda r: r["durable"]["total_s"] / r["memory"]["total_s"]
        ),
        "durable_over_memory_load": paired(
            rows, lambda r: r["durable"]["load_s"] / r["memory"]["load_s"]
        ),
    }
    return out


async def run(env: Env, mib: int, trials: int) -> dict[str, Any]:
    """`trials` trials, each both variants in a shuffled order."""
    rows = []
    for trial in range(trials):
        order = list(VARIANTS)
        random.Random(100 + trial).shuffle(order)
        row: dict[str, Any] = {"order": order, "loadavg": os.getloadavg()[0]}
        for n, variant in enumerate(order):
            seed = 1000 + 10 * trial + n
            row[variant] = await recover_once(env, variant, seed, mib * disk.MiB)
        log.info("recovery trial %d: %s", trial, ", ".join(
            f"{v} {row[v]['total_s']:.2f}s (remove {row[v]['remove_s']:.2f}, recreate "
            f"{row[v]['recreate_s']:.2f}, load {row[v]['load_s']:.2f})" for v in VARIANTS))  # fmt: skip
        rows.append(row)
    return {"state_mib": mib, "trials": rows, "summary": summarize(rows)}
