"""Part "saveload" of `python -m benchmarks.tiers`: one `Checkpointable` actor on node_a holds
the state under test; `CheckpointCoordinator.save()` (sync, until committed) and `load()` (into
the same actor) are timed against three targets, with the raw disk measured in the same trial:

- memory: the replicated memory tier (`memory_every=1`, `memory_copies=2`: the holders on the
  head and node_b each keep a copy); `durable_every` so large that nothing is persisted;
- disk: a local folder (`memory_every=0`); its load starts with the files evicted from the
  page cache;
- s3: the SeaweedFS server; its data folder is evicted from the page cache before the load;
- raw: `disk.python_write` (write + fsync) and `disk.cold_read` of as many bytes as the step;
- sock: the raw transport under the memory tier's data plane (`raw.py`): plain TCP
  send/recv of as many bytes between actors on node_a, the head and node_b;
- ray: Ray's object store path (the memory tier's fallback) without forge_ckpt: `ray.put` of as many bytes on node_a, then
  `ray.get` + CRC32C on the head and on node_b at once (two copies, as `memory_copies=2`), then
  node_a pulls the head's heap copy back (a call's return value, as a memory load reads).

Every trial runs the six in an order shuffled by the trial number; each save holds a state
drawn from a fresh seed, and each load is checked against it by a digest computed in the actor.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from typing import Any

import ray

from forge_ckpt import CheckpointConfig, CheckpointCoordinator
from forge_ckpt.steps import commit

from .. import contention, disk
from . import raw
from .actors import Probe, TensorState
from .env import Env, spawn
from .stats import VerifyError, check, paired, spread

log = logging.getLogger("benchmarks")
TARGETS = ("memory", "disk", "s3")
NEVER = 10**9  # durable_every: no persist during the measured saves
EXPECT_TIER = {"memory": "memory", "disk": "durable", "s3": "durable"}


@dataclass
class Ctx:
    env: Env
    actor: Any  # the TensorState actor on node_a
    probes: dict[str, Any]  # a Probe actor on each node: the raw Ray transfer
    peers: dict[str, Any]  # a RawPeer actor on each node: the raw socket transfer
    coords: dict[str, CheckpointCoordinator]
    state_bytes: int
    nbytes: int = 0  # bytes of one step (from the warm-up): the raw baseline's size
    step: int = 0


def _configs(env: Env, state_bytes: int) -> dict[str, CheckpointConfig]:
    budget = max(8 * 1024**3, 3 * state_bytes)
    memory = CheckpointConfig(
        folder=os.path.join(env.root, "memory-durable"),
        memory_every=1,
        durable_every=NEVER,
        memory_copies=2,
        memory_keep=1,
        memory_budget_bytes=budget,
        keep_last=None,
    )
    disk_cfg = CheckpointConfig(folder=os.path.join(env.root, "disk"), keep_last=None)
    s3 = CheckpointConfig(
        folder=env.s3_url("saveload"), storage_options=env.s3_options(), keep_last=None
    )
    return {"memory": memory, "disk": disk_cfg, "s3": s3}


def _evict(c: Ctx, target: str) -> bool:
    """Make the load read its medium: the folder's files (disk) or the server's data (S3)."""
    if target == "disk":
        disk.drop_cache([c.coords["disk"].config.folder], c.env.cache)
    elif target == "s3":
        disk.drop_cache([c.env.s3_data], c.env.cache)
    return target != "memory"


async def _discard(c: Ctx, target: str, step: int) -> None:
    """Remove the step (untimed): holders free its memory, folders its bytes."""
    coord = c.coords[target]
    if coord.tier is not None:
        await asyncio.to_thread(coord.tier.wipe)
    else:
        await asyncio.to_thread(commit.remove_step, coord.store, step)
    await asyncio.to_thread(disk.settle)


async def one_target(c: Ctx, target: str) -> dict[str, Any]:
    """Fill, save (timed), drop the actor's state, evict, load (timed), check, discard."""
    c.step += 1
    step, coord = c.step, c.coords[target]
    want = await c.actor.fill.remote(c.state_bytes, step)
    await asyncio.to_thread(disk.settle)
    await c.actor.phases.remote()  # reset
    cpu0, t0 = contention.machine_cpu_s(), time.perf_counter()
    saved = await coord.save(step)
    save_s = time.perf_counter() - t0
    save_cpu_s = contention.machine_cpu_s() - cpu0
    save_phases = await c.actor.phases.remote()
    await c.actor.drop.remote()
    evicted = await asyncio.to_thread(_evict, c, target)
    cpu0, t0 = contention.machine_cpu_s(), time.perf_counter()
    loaded = await coord.load()
    load_s = time.perf_counter() - t0
    load_cpu_s = contention.machine_cpu_s() - cpu0
    load_phases = await c.actor.phases.remote()
    if loaded is None:
        raise VerifyError(f"{target}: load() found no step")
    check(f"{target} step {step} tier", (loaded.step, loaded.tier), (step, EXPECT_TIER[target]))
    check(f"{target} step {step} state", await c.actor.digest.remote(), want)
    await _discard(c, target, step)
    return {"save_s": save_s, "load_s": load_s, "bytes": saved.nbytes, "evicted": evicted,
            "save_cpu_s": save_cpu_s, "load_cpu_s": load_cpu_s,
            "committed": saved.committed, "verified": True,
            "phases": {"save": save_phases, "load": load_phases}}  # fmt: skip


async def raw_disk(c: Ctx) -> dict[str, Any]:
    """The disk's own speed on the step's bytes: write + fsync, then a cold sequential read."""
    path = os.path.join(c.env.root, "raw.bin")
    write_s = await asyncio.to_thread(disk.python_write, path, c.nbytes)
    read_s = await asyncio.to_thread(disk.cold_read, path, c.env.cache)
    await asyncio.to_thread(disk.remove, path)
    return {"write_s": write_s, "read_s": read_s, "bytes": c.nbytes}


async def raw_ray(c: Ctx) -> dict[str, Any]:
    """One put on node_a, two pulls (head, node_b) at once, each CRC32C'd where it lands."""
    p = c.probes
    refs, put_s = await p["node_a"].put.remote(c.nbytes)
    t0 = time.perf_counter()
    got = await asyncio.gather(p["head"].fetch.remote(refs), p["node_b"].fetch.remote(refs))
    both_s = time.perf_counter() - t0
    await p["node_a"].release.remote()
    pull_s = await p["node_a"].pull.remote(p["head"])
    await asyncio.gather(*(x.release.remote() for x in p.values()))
    return {"put_s": put_s, "copies_s": both_s, "get_s": max(g["get_s"] for g in got),
            "crc_s": max(g["crc_s"] for g in got), "pull_s": pull_s, "bytes": c.nbytes}  # fmt: skip


async def _trial(c: Ctx, trial: int) -> dict[str, Any]:
    order = [*TARGETS, "raw", "ray", "sock"]
    random.Random(trial).shuffle(order)
    row: dict[str, Any] = {"order": order, "loadavg": os.getloadavg()[0]}
    for name in order:
        if name in TARGETS:
            row[name] = await one_target(c, name)
        elif name == "sock":
            row[name] = await raw.measure(c.peers, c.nbytes)
        else:
            row[name] = await (raw_disk(c) if name == "raw" else raw_ray(c))
    log.info("saveload trial %d: %s", trial, _brief(row))
    return row


def _brief(row: dict[str, Any]) -> str:
    return ", ".join(
        f"{t} save {row[t]['save_s']:.2f}s load {row[t]['load_s']:.2f}s" for t in TARGETS
    ) + (
        f", raw write {row['raw']['write_s']:.2f}s read {row['raw']['read_s']:.2f}s, ray put "
        f"{row['ray']['put_s']:.2f}s + 2 copies {row['ray']['copies_s']:.2f}s, socket 2 "
        f"copies {row['sock']['send_s']:.2f}s, recv {row['sock']['recv1_s']:.2f}s / "
        f"{row['sock']['recv2_s']:.2f}s (1 / 2 streams)"
    )


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of seconds, and paired ratios (each inside its trial, median over trials)."""
    seconds = {f"{t}_{op}": spread(r[t][f"{op}_s"] for r in rows) for t in TARGETS
               for op in ("save", "load")}  # fmt: skip
    seconds["raw_write"] = spread(r["raw"]["write_s"] for r in rows)
    seconds["raw_read"] = spread(r["raw"]["read_s"] for r in rows)
    for k in ("put", "copies", "get", "crc", "pull"):
        seconds[f"ray_{k}"] = spread(r["ray"][f"{k}_s"] for r in rows)
    for k in ("send", "recv1", "recv2"):
        seconds[f"sock_{k}"] = spread(r["sock"][f"{k}_s"] for r in rows)
    # Machine CPU-seconds (every process: cluster, actors, holders) during each measurement.
    cpu = {f"{t}_{op}": spread(r[t][f"{op}_cpu_s"] for r in rows) for t in TARGETS
           for op in ("save", "load")}  # fmt: skip
    for k in ("send", "recv2"):
        cpu[f"sock_{k}"] = spread(r["sock"][f"{k}_cpu_s"] for r in rows)

    def speedup(other: str, op: str) -> dict[str, float]:
        return paired(rows, lambda r: r[other][f"{op}_s"] / r["memory"][f"{op}_s"])

    vs_raw = {}
    for t in TARGETS:  # throughput against the raw disk's (higher is better)
        vs_raw[f"{t}_save"] = spread(r["raw"]["write_s"] / r[t]["save_s"] for r in rows)
        vs_raw[f"{t}_load"] = spread(r["raw"]["read_s"] / r[t]["load_s"] for r in rows)
    ratios = {f"memory_{op}_speedup_vs_{other}": speedup(other, op)
              for op in ("load", "save") for other in ("disk", "s3")}  # fmt: skip
    # Throughput against the raw transport's (its faster read: one stream or two).
    ratios["memory_save_vs_transport"] = paired(
        rows, lambda r: r["sock"]["send_s"] / r["memory"]["save_s"]
    )
    ratios["memory_load_vs_transport"] = paired(
        rows, lambda r: min(r["sock"]["recv1_s"], r["sock"]["recv2_s"]) / r["memory"]["load_s"]
    )
    return {
        "seconds": seconds,
        "machine_cpu_s": cpu,
        "ratios": ratios,
        "vs_raw": vs_raw,
        "phases": {t: _phases(rows, t) for t in TARGETS},
    }


def _phases(rows: list[dict[str, Any]], target: str) -> dict[str, Any]:
    """Medians of where a save's and a load's time went (actor side, memory-tier Ray steps);
    'driver' is the rest: the coordinator's calls, the commit, listing and choosing the step."""
    out: dict[str, Any] = {}
    for op in ("save", "load"):
        names = sorted({k for r in rows for k in r[target]["phases"][op]})
        out[op] = {k: spread(r[target]["phases"][op].get(k, 0.0) for r in rows) for k in names}
        actor = [sum(v for k, v in r[target]["phases"][op].items() if k.startswith("actor_"))
                 for r in rows]  # fmt: skip
        out[op]["driver"] = spread(
            r[target][f"{op}_s"] - a for r, a in zip(rows, actor, strict=True)
        )
    return out


async def _setup(env: Env, state_bytes: int) -> Ctx:
    actor = spawn(TensorState, "node_a")
    await actor.ping.remote()
    probes = {n: spawn(Probe, n) for n in ("head", "node_a", "node_b")}
    peers = {n: spawn(raw.RawPeer, n) for n in ("head", "node_a", "node_b")}
    coords: dict[str, CheckpointCoordinator] = {}
    for name, cfg in _configs(env, state_bytes).items():
        coords[name] = await asyncio.to_thread(CheckpointCoordinator, cfg)
        coords[name].register("state", actor)
    return Ctx(env, actor, probes, peers, coords, state_bytes)


async def _teardown(c: Ctx) -> None:
    for coord in c.coords.values():
        if coord.tier is not None:
            await asyncio.to_thread(coord.tier.shutdown)
        coord.close()
    for a in [c.actor, *c.probes.values(), *c.peers.values()]:
        ray.kill(a)
    for cfg_name in ("memory", "disk"):
        shutil.rmtree(c.coords[cfg_name].config.folder, ignore_errors=True)


async def run(env: Env, mib: int, trials: int) -> dict[str, Any]:
    """An untimed warm-up of each target (holders' first put, S3 clients, page faults), then
    `trials` trials; returns the per-trial rows and their summary."""
    c = await _setup(env, mib * disk.MiB)
    try:
        warm = {t: await one_target(c, t) for t in TARGETS}
        c.nbytes = warm["disk"]["bytes"]
        warm["ray"] = await raw_ray(c)
        warm["sock"] = await raw.measure(c.peers, c.nbytes)
        rows = [await _trial(c, t) for t in range(trials)]
    finally:
        await _teardown(c)
    return {"state_mib": mib, "trials": rows, "warm_up": warm, "bytes": c.nbytes,
            "cache_method": env.cache, "summary": summarize(rows)}  # fmt: skip
