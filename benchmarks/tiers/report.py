"""The report of `python -m benchmarks.tiers`: `benchmarks_tiers.json` and the section of
`benchmarks.md` between `<!-- tiers:begin -->` and `<!-- tiers:end -->` (added at the end of
the page, or replaced in place; the rest of the page is untouched)."""

from __future__ import annotations

import json
import os
from typing import Any

from .. import sections

BEGIN, END = sections.markers("tiers")
TARGET_SPEEDUP = 2.0  # memory-tier save and load vs the local disk's (issue 23)
TARGET_TRANSPORT = 0.7  # memory-tier save and load throughput / the raw transport's
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
    return [
        f"### Save and load of {p['state_mib']} MiB held by one actor",
        "",
        f"One `Checkpointable` actor on node_a holds {nb / MiB:.0f} MiB (16 float32 tensors); "
        "`save()` is synchronous (returns once committed), `load()` restores into the same "
        f"actor. Median over {len(p['trials'])} trials (min-max); every trial runs the six "
        "measurements in a shuffled order.",
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
        f"load reads) {_s(sec['ray_pull'])} s. (Ray's object store is now only the tier's "
        "fallback.)",
        "",
        *_transport(p),
        "",
        "| Ratio (paired: inside each trial, median over trials) | Target | Measured | Result |",
        "|---|---|---|---|",
        _row("memory-tier load speedup vs local-disk load", r["memory_load_speedup_vs_disk"],
             TARGET_SPEEDUP, "x"),
        _row("memory-tier save speedup vs local-disk save", r["memory_save_speedup_vs_disk"],
             TARGET_SPEEDUP, "x"),
        _row("memory-tier load throughput / raw transport", r.get("memory_load_vs_transport"),
             TARGET_TRANSPORT),
        _row("memory-tier save throughput / raw transport", r.get("memory_save_vs_transport"),
             TARGET_TRANSPORT),
        f"| memory-tier load speedup vs S3 load | - | {_x(r['memory_load_speedup_vs_s3'])} | |",
        f"| memory-tier save speedup vs S3 save | - | {_x(r['memory_save_speedup_vs_s3'])} | |",
        "",
    ]  # fmt: skip


def _row(name: str, d: dict[str, float] | None, target: float, unit: str = "") -> str:
    if d is None:
        return f"| {name} | >= {target:g}{unit} | not measured | |"
    met = "met" if d["median"] >= target else "missed"
    shown = _x(d) if unit == "x" else _s(d)
    return f"| {name} | >= {target:g}{unit} | {shown} | **{met}** |"


def _transport(p: dict[str, Any]) -> list[str]:
    """The raw transport's line (absent from runs made before it was measured)."""
    sec, nb = p["summary"]["seconds"], p["bytes"]
    if "sock_send" not in sec:
        return []
    return [
        "Raw transport under the tier's data plane, same bytes, no forge_ckpt (plain TCP "
        "`sendall` / `recv_into` between actors on different nodes, `benchmarks/tiers/raw.py`): "
        f"node_a to the head and node_b at once {_s(sec['sock_send'])} s "
        f"({_mbs(nb, sec['sock_send'])} MB/s per copy); node_a receiving from the head "
        f"{_s(sec['sock_recv1'])} s ({_mbs(nb, sec['sock_recv1'])} MB/s), from the head and "
        f"node_b, half each, {_s(sec['sock_recv2'])} s ({_mbs(nb, sec['sock_recv2'])} MB/s). "
        "A load is compared with the faster of the two reads of its trial."
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
        out += _limits_cpu(parts["saveload"], res["machine"]["cores"])
        out += _limits_durable(parts["saveload"])
        out += _target_note(parts["saveload"])
    if "recovery" in parts:
        out += _limits_recovery(parts["recovery"])
    return out


def _med(d: dict[str, Any], key: str) -> float:
    return float(d[key]["median"]) if key in d else 0.0


def _limits_memory(p: dict[str, Any], cores: int) -> list[str]:
    sec, ph = p["summary"]["seconds"], p["summary"]["phases"]["memory"]
    sv, ld = ph["save"], ph["load"]
    close, act = _med(sv, "mem_close"), _med(sv, "actor_save")
    read, prep = _med(ld, "mem_read"), _med(ld, "actor_prepare_load")
    send = _med(sec, "sock_send")
    recv = min(_med(sec, "sock_recv1"), _med(sec, "sock_recv2")) if send else 0.0
    return [
        f"- **Memory-tier save** ({_med(sec, 'memory_save'):.2f} s): the actor's share is "
        f"{act:.2f} s: it encodes the state (CRC32C over every byte; the tensors are not "
        "copied: `Writer.write_held`) while two streams send each part, from the tensors "
        "themselves, to the holders on the head and node_b (`memory/writer.py`; since "
        "2026-11-28 16:40, before that every byte was first copied into a file-sized buffer; "
        "each holder receives into the buffer it keeps, CRC32C as "
        f"the bytes arrive); after the last byte, {close:.2f} s go to the last parts and the "
        f"holders' checks and acks. The raw transport sends the same two copies in {send:.2f} "
        f"s. The driver's share ({_med(sv, 'driver'):.2f} s) is the manifest and COMMIT "
        f"written to every holder, and retention. Everything shares {cores} cores with three "
        "raylets.",
        f"- **Memory-tier load** ({_med(sec, 'memory_load'):.2f} s): reading the file takes "
        f"{read:.2f} s of the actor's {prep:.2f} s (node_a holds no copy: the writer's node "
        "never does; the read is split over the two holders, each part streamed into its "
        f"place in one buffer; the raw transport's faster read takes {recv:.2f} s); CRC32C "
        "and decoding (tensors are views of that buffer) are the rest, then the driver's "
        "calls (listing the steps, checking the step is whole).",
    ]


def _limits_cpu(p: dict[str, Any], cores: int) -> list[str]:
    """The machine's CPU during the memory save and the raw send (every process): where both
    keep the cores busy, the CPU work per byte sets the ratio, not the transport."""
    sec, cpu = p["summary"]["seconds"], p["summary"].get("machine_cpu_s")
    if not cpu or "sock_send" not in cpu:
        return []
    save_s, send_s = _med(sec, "memory_save"), _med(sec, "sock_send")
    save_cpu, send_cpu = _med(cpu, "memory_save"), _med(cpu, "sock_send")
    if not (save_s and send_s and save_cpu and send_cpu):
        return []
    floor = save_cpu / cores  # the save's wall time if its CPU work ran on every core at once
    return [
        f"- **CPU, memory save against the raw send** (the whole machine's busy CPU-seconds "
        "from /proc/stat during each, every process of the cluster included): the save used "
        f"{save_cpu:.2f} CPU-s in {save_s:.2f} s ({save_cpu / save_s / cores:.0%} of {cores} "
        f"cores), the raw send {send_cpu:.2f} CPU-s in {send_s:.2f} s "
        f"({send_cpu / send_s / cores:.0%}). The save does {save_cpu / send_cpu:.1f}x the raw "
        "send's CPU work for the same two copies: the writer's CRC32C, the holders' CRC32C as "
        "the bytes arrive, the protocol's calls (the parts are sent from the tensors, with no "
        f"copy in the writer). Even on all {cores} cores at once that work takes {floor:.2f} "
        f"s, so on this machine the save's throughput is at most {send_s / floor:.2f}x the raw "
        "send's (the target is 0.7x). What is left to cut is the checksum work (three passes "
        "over the bytes: the writer's and each holder's), or the holders get cores of their "
        "own, as on separate machines.",
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
    """What bounds the memory tier's ratios against the disk when a target is missed."""
    sec, nb, r = p["summary"]["seconds"], p["bytes"], p["summary"]["ratios"]
    worst = min(r["memory_load_speedup_vs_disk"]["median"],
                r["memory_save_speedup_vs_disk"]["median"])  # fmt: skip
    if worst >= TARGET_SPEEDUP or "sock_send" not in sec:
        return []
    send, cold = nb / _med(sec, "sock_send") / 1e6, nb / _med(sec, "raw_read") / 1e6
    write = nb / _med(sec, "raw_write") / 1e6
    recv = nb / min(_med(sec, "sock_recv1"), _med(sec, "sock_recv2")) / 1e6
    return [
        f"- **Against the disk** (worst {worst:.2f}x, target {TARGET_SPEEDUP:g}x): a memory "
        "save or load can be at most as fast as the raw transport, which here moves "
        f"~{send:.0f} MB/s per copy to two holders at once and reads ~{recv:.0f} MB/s, on "
        f"the same 2 cores as every process of the cluster; the disk writes ~{write:.0f} MB/s "
        f"(with fsync) and reads ~{cold:.0f} MB/s cold. Where the raw transport is not 2x "
        "the disk, no data plane reaches 2x here; on separate machines each holder "
        "receives on its own cores and the network's bandwidth sets the bound.",
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
