"""The report of `python -m benchmarks.tiers`: `benchmarks_tiers.json` and the section of
`benchmarks.md` between `<!-- tiers:begin -->` and `<!-- tiers:end -->` (added at the end of
the page, or replaced in place; the rest of the page is untouched)."""

from __future__ import annotations

import json
import os
from typing import Any

from . import sections

BEGIN, END = sections.markers("tiers")
TARGET_LOAD_SPEEDUP = 5.0  # memory-tier load vs local-disk load (the target)
MiB = 1 << 20


def _s(d: dict[str, float], fmt: str = "{:.2f}") -> str:
    """'median (min-max)' of a spread."""
    return f"{fmt.format(d['median'])} ({fmt.format(d['min'])}-{fmt.format(d['max'])})"


def _x(d: dict[str, float]) -> str:
    return _s(d).replace(" (", "x (", 1)


def _mbs(nbytes: int, d: dict[str, float]) -> str:
    return f"{nbytes / d['median'] / 1e6:.0f}"


def _header(res: dict[str, Any]) -> list[str]:
    m = res["machine"]
    cache = (
        "dropped before every disk load, S3 load and raw read with `echo 1 > "
        "/proc/sys/vm/drop_caches` (after `sync`), plus `posix_fadvise(DONTNEED)` on the files"
        if res["cache_method"] == "drop_caches"
        else "could **not** be dropped (no write access to /proc/sys/vm/drop_caches): only "
        "`posix_fadvise(DONTNEED)` on the files before each read, which the kernel may ignore"
    )
    loads = [r["loadavg"] for p in res["parts"].values() for r in p["trials"]]
    load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "?"
    busy = loads and max(loads) > m["cores"]
    if busy:
        load += (
            f" on {m['cores']} cores: **other processes were competing for the CPU and the "
            "disk** during the run, which widens the spread; read the paired ratios, and the "
            "min-max, rather than any single figure"
        )
    else:
        load += f" on {m['cores']} cores"
    return [
        f"- Command: `{res['command']}` (date {res['date']}; wall time "
        f"{res['wall_s'] / 60:.1f} min)",
        f"- Machine: {m['cores']} cores ({m['cpu']}), {m['ram_bytes'] / 2**30:.1f} GiB RAM, "
        f"Linux {m['kernel']}; disk under test: {m['filesystem']}; Python {m['python']}, torch "
        f"{m['torch']}, ray {m['ray']}, forge_ckpt {m['forge_ckpt']}",
        "- Cluster: `ray.cluster_utils.Cluster` on this machine: head + node_a + node_b, each "
        f"its own raylet and object store of {res['config']['mib'] * 2.5 / 1024:.1f} GiB; "
        "loopback, so a node-to-node transfer is a copy through local TCP, not a network. S3: "
        "SeaweedFS on loopback, its data on the same disk.",
        f"- Page cache: {cache}.",
        f"- Load average (1 min) at the start of each trial: {load}.",
        "- Every load was checked bitwise against the state saved (a CRC32C of each tensor, "
        "the metadata and the RNG state, computed in the actor; each save draws a fresh seed).",
    ]


def _saveload(p: dict[str, Any]) -> list[str]:
    s, sec, vr, nb = p["summary"], p["summary"]["seconds"], p["summary"]["vs_raw"], p["bytes"]
    r = s["ratios"]
    met = r["memory_load_speedup_vs_disk"]["median"] >= TARGET_LOAD_SPEEDUP
    return [
        f"### Save and load of {p['state_mib']} MiB held by one actor",
        "",
        f"One `Checkpointable` actor on node_a holds {nb / MiB:.0f} MiB (16 float32 tensors); "
        "`save()` is synchronous (returns once committed), `load()` restores into the same "
        f"actor. Median over {len(p['trials'])} trials (min-max); every trial runs the five "
        "columns in a shuffled order.",
        "",
        "| | memory tier (2 copies) | local disk | S3 (SeaweedFS) | raw disk |",
        "|---|---:|---:|---:|---:|",
        f"| save, s | {_s(sec['memory_save'])} | {_s(sec['disk_save'])} | {_s(sec['s3_save'])} "
        f"| {_s(sec['raw_write'])} (write + fsync) |",
        f"| load, s | {_s(sec['memory_load'])} | {_s(sec['disk_load'])} | {_s(sec['s3_load'])} "
        f"| {_s(sec['raw_read'])} (cold read) |",
        f"| save, MB/s | {_mbs(nb, sec['memory_save'])} | {_mbs(nb, sec['disk_save'])} | "
        f"{_mbs(nb, sec['s3_save'])} | {_mbs(nb, sec['raw_write'])} |",
        f"| load, MB/s | {_mbs(nb, sec['memory_load'])} | {_mbs(nb, sec['disk_load'])} | "
        f"{_mbs(nb, sec['s3_load'])} | {_mbs(nb, sec['raw_read'])} |",
        f"| save throughput / raw write | {_s(vr['memory_save'])} | {_s(vr['disk_save'])} | "
        f"{_s(vr['s3_save'])} | 1 |",
        f"| load throughput / raw cold read | {_s(vr['memory_load'])} | {_s(vr['disk_load'])} | "
        f"{_s(vr['s3_load'])} | 1 |",
        "",
        f"Raw Ray path of the memory tier, same bytes, no forge_ckpt: `ray.put` on node_a "
        f"{_s(sec['ray_put'])} s, then `ray.get` + CRC32C on the head and node_b at once "
        f"{_s(sec['ray_copies'])} s (of which the slower `ray.get` {_s(sec['ray_get'])} s, "
        f"CRC32C {_s(sec['ray_crc'])} s); node_a pulling a holder's heap copy back (what a "
        f"load reads) {_s(sec['ray_pull'])} s.",
        "",
        "| Ratio (paired: inside each trial, median over trials) | Target | Measured | Result |",
        "|---|---|---|---|",
        f"| memory-tier load speedup vs local-disk load | >= {TARGET_LOAD_SPEEDUP:.0f}x | "
        f"{_x(r['memory_load_speedup_vs_disk'])} | **{'met' if met else 'missed'}** |",
        f"| memory-tier load speedup vs S3 load | - | {_x(r['memory_load_speedup_vs_s3'])} | |",
        f"| memory-tier save speedup vs local-disk save | - | "
        f"{_x(r['memory_save_speedup_vs_disk'])} | |",
        f"| memory-tier save speedup vs S3 save | - | {_x(r['memory_save_speedup_vs_s3'])} | |",
        "",
    ]


def _recovery(p: dict[str, Any]) -> list[str]:
    s = p["summary"]
    m, d, r = s["memory"], s["durable"], s["ratios"]
    rows = [("removal until the state is restored (total)", "total_s"),
            ("`remove_node` (raylet, store and workers killed)", "remove_s"),
            ("recreate both actors on node_b (until they answer)", "recreate_s"),
            ("`load()` into them", "load_s")]  # fmt: skip
    out = [
        "### Recovery after losing a node",
        "",
        f"node_a holds a {p['state_mib']} MiB `Checkpointable` actor and a small one; step 1 is "
        "saved to memory and persisted to S3 (`durable_every=1`), then node_a is removed "
        "(`remove_node(allow_graceful=False)`) and the clock runs until `load()` has restored "
        "both actors, recreated on node_b. *memory*: the same coordinator, `LoadResult.tier` "
        "== 'memory' (copies on the head and node_b). *durable*: a coordinator with "
        "`memory_every=0` on the same S3 folder (holders shut down before the removal), the "
        f"S3 data evicted from the page cache. Median over {len(p['trials'])} trials (min-max), "
        "seconds.",
        "",
        "| seconds | from memory | from durable (S3) |",
        "|---|---:|---:|",
    ]
    out += [f"| {label} | {_s(m[k])} | {_s(d[k])} |" for label, k in rows]
    out += [
        "",
        f"Recovery from durable / recovery from memory (paired): {_x(r['durable_over_memory_total'])}"
        f" in total, {_x(r['durable_over_memory_load'])} for `load()` alone.",
        "",
    ]
    return out


def _planned(res: dict[str, Any]) -> list[str]:
    if not res["planned"]:
        return []
    rows = [f"| {x['title']} | not measured yet (part `{x['name']}`) |" for x in res["planned"]]
    return ["### Not measured yet", "", "| Figure | Status |", "|---|---|", *rows, ""]


def markdown(res: dict[str, Any]) -> str:
    """The whole section, markers included."""
    lines = [BEGIN, "## Tiers: the replicated memory tier against the local disk and S3", ""]
    lines += [*_header(res), ""]
    parts = res["parts"]
    if "saveload" in parts:
        lines += _saveload(parts["saveload"])
    if "recovery" in parts:
        lines += _recovery(parts["recovery"])
    lines += _planned(res)
    lines += limits(res)
    if res["errors"]:
        lines += ["### Errors", "", *[f"- {e}" for e in res["errors"]], ""]
    return "\n".join([*lines, END]) + "\n"


def limits(res: dict[str, Any]) -> list[str]:
    """What limits each figure: one paragraph each, with the run's own phase timings."""
    parts, out = res["parts"], ["### What limits them", ""]
    if "saveload" in parts:
        out += _limits_memory(parts["saveload"], res["machine"]["cores"])
        out += _limits_durable(parts["saveload"])
        out += _target_note(parts["saveload"])
    if "recovery" in parts:
        out += _limits_recovery(parts["recovery"])
    return out


def _med(d: dict[str, Any], key: str) -> float:
    return float(d[key]["median"]) if key in d else 0.0


def _limits_memory(p: dict[str, Any], cores: int) -> list[str]:
    sec, ph, nb = p["summary"]["seconds"], p["summary"]["phases"]["memory"], p["bytes"]
    sv, ld = ph["save"], ph["load"]
    put, act = _med(sv, "mem_put_copies"), _med(sv, "actor_save")
    raw = _med(sec, "ray_put") + _med(sec, "ray_copies")
    pull, read = _med(sec, "ray_pull"), _med(ld, "mem_read")
    prep = _med(ld, "actor_prepare_load")
    mbs = nb / _med(sec, "ray_get") / 1e6
    return [
        f"- **Memory-tier save** ({_med(sec, 'memory_save'):.2f} s): the actor's share is "
        f"{act:.2f} s, of which {put:.2f} s hand the file to the holders (`ray.put` in the "
        "actor, then the holders on the head and node_b each pull the object from node_a's "
        "store, CRC32C it and keep a heap copy, then ack) and the rest encodes the state into "
        "the writer's buffer (one copy per chunk with CRC32C, then a join into one `bytes`). "
        f"The same bytes through Ray alone (put + two pulls + CRC32C) take {raw:.2f} s: the "
        f"save is bound by Ray's object transfer between raylets (~{mbs:.0f} MB/s per pull "
        "here: chunked gRPC over loopback), then by the memory copies and CRC32C on both "
        f"sides, all on {cores} cores shared by the writer, both holders, three raylets and "
        f"whatever else runs. The driver's share ({_med(sv, 'driver'):.2f} s) is the manifest "
        "and COMMIT written to every holder, and retention.",
        f"- **Memory-tier load** ({_med(sec, 'memory_load'):.2f} s): reading the file back "
        f"takes {read:.2f} s of the actor's {prep:.2f} s (node_a holds no copy: the writer's "
        "node never does. Each holder returns a numpy view of its heap copy, which Ray puts "
        "into that holder's store out of band and pulls to node_a; the file is read as one "
        "part from each holder, in parallel, copied into one `bytearray` by "
        "`MemoryStorage.read`); CRC32C and decoding (tensors are views of that buffer) are "
        f"the rest. Ray alone pulls the same bytes from one holder in {pull:.2f} s: the load "
        "is bound by Ray's transfers between raylets on this machine.",
    ]


def _limits_durable(p: dict[str, Any]) -> list[str]:
    sec = p["summary"]["seconds"]
    dsv, dld = sec["disk_save"], sec["disk_load"]
    return [
        f"- **Local-disk save** ({_s(dsv)} s; raw write + fsync {_s(sec['raw_write'])} s) and "
        f"**load** ({_s(dld)} s; raw cold read {_s(sec['raw_read'])} s): one file written by "
        "the actor (encode, CRC32C, write, fsync) and read back into one buffer (read, CRC32C, "
        "decode): bound by the disk's bandwidth, and by the CPU for the encoding and CRC32C "
        "when the cores are busy (the raw baselines do neither). The disk is this VM's virtio "
        "disk: the guest's page cache is dropped before each read, the host's may still serve "
        "some of it, so the 'cold' disk is fast here.",
        f"- **S3 save** ({_med(sec, 's3_save'):.2f} s) and **load** ({_med(sec, 's3_load'):.2f} "
        "s): a multipart upload (32 MiB parts, 8 in flight) and parallel ranged GETs to "
        "SeaweedFS on loopback: bound by SeaweedFS's own CPU work (filer and volume server, "
        "chunking and checksums) on the same 2 cores, then by the same disk; a remote bucket "
        "adds the network.",
    ]


def _target_note(p: dict[str, Any]) -> list[str]:
    """Why the load-speedup target is missed, when it is."""
    sec, nb = p["summary"]["seconds"], p["bytes"]
    ratio = p["summary"]["ratios"]["memory_load_speedup_vs_disk"]["median"]
    if ratio >= TARGET_LOAD_SPEEDUP:
        return []
    pull, cold = nb / _med(sec, "ray_pull") / 1e6, nb / _med(sec, "raw_read") / 1e6
    extra = _med(sec, "memory_load") - _med(sec, "ray_pull")
    return [
        f"- **Why the {TARGET_LOAD_SPEEDUP:.0f}x load target is missed here** "
        f"({ratio:.2f}x): a memory-tier load can only be as fast as Ray moving the bytes from a "
        f"holder, and on this VM Ray pulls ~{pull:.0f} MB/s between its three raylets (same "
        f"2 cores, loopback) while the disk reads ~{cold:.0f} MB/s cold. The target needs the "
        "opposite: a transfer from a peer's RAM that beats the durable tier (many cores per "
        "node and a fast network, or a slow or remote durable tier); this single VM cannot "
        f"show it. What forge_ckpt adds on top of Ray's pull is {extra:.2f} s per load "
        "(one more copy into a `bytearray`, CRC32C, decoding, the driver's calls).",
    ]


def _limits_recovery(p: dict[str, Any]) -> list[str]:
    m, d = p["summary"]["memory"], p["summary"]["durable"]
    return [
        f"- **Recovery** (from memory {_med(m, 'total_s'):.2f} s, from S3 "
        f"{_med(d, 'total_s'):.2f} s): `remove_node` returns at once (SIGKILL). Recreating "
        f"the two actors on node_b ({_s(m['recreate_s'])} / {_s(d['recreate_s'])} s) is the "
        "same work for both, a new Ray worker process per actor importing torch; its spread "
        "is the machine's load, not the tier, and it overlaps Ray's detection of the dead node "
        "(health checks every 0.5 s, 4 misses). What the tier changes is `load()`: the "
        "recreated actor runs on node_b, which holds a copy, and a read goes to the holder on "
        "the reader's own node first: the bytes move through node_b's shared-memory object "
        "store, not between raylets (compare the load from node_a above); the durable tier "
        "GETs them from S3 (SeaweedFS reading cold). The `load()` ratio is the one that speaks "
        "for the tier.",
    ]


def write(res: dict[str, Any], out: str) -> None:
    """`out`/benchmarks_tiers.json, and the section in `out`/benchmarks.md (created if absent)."""
    os.makedirs(out, exist_ok=True)
    sections.write_section("tiers", markdown(res), json.loads(json.dumps(res, default=str)), out)
