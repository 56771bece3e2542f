"""Actor scaling: the same total bytes held by 1..N actors (summary, table, analysis, plot)."""

from __future__ import annotations

import statistics
from typing import Any

from .common import MiB, fmt, med, met, secs, series, table

# ---- actor scaling ----------------------------------------------------------------------------


def actor_summary(point: dict, base: dict | None) -> dict[str, Any]:
    rows = point["trials"]
    out: dict[str, Any] = {"actors": point["actors"], "bytes": point["bytes"]}
    out["sync_s"] = series(rows, lambda r: r["forge_sync"]["total_s"])
    out["async_blocked_s"] = series(rows, lambda r: r["forge_async"]["blocked_s"])
    out["async_total_s"] = series(rows, lambda r: r["forge_async"]["total_s"])
    out["load_s"] = series(rows, lambda r: r["forge_sync"]["load"]["seconds"])
    out["raw_write_s"] = series(rows, lambda r: r["raw"]["write_s"])
    out["raw_read_s"] = series(rows, lambda r: r["raw"]["read_s"])
    out["sync_vs_raw"] = series(rows, lambda r: r["raw"]["write_s"] / r["forge_sync"]["total_s"])
    out["files_write_s"] = series(rows, lambda r: r["raw"]["files_write_s"])
    out["ping_s"] = series(rows, lambda r: r["raw"]["ping_s"])
    out["poll_slack_s"] = series(rows, lambda r: r["forge_sync"]["poll_slack_s"])
    if base is not None:
        b_sync = med(base["sync_s"])
        b_norm = med(
            series(base["_rows"], lambda r: r["forge_sync"]["total_s"] / r["raw"]["write_s"])
        )
        out["sync_vs_1"] = [x / b_sync for x in out["sync_s"]] if b_sync else []
        out["sync_vs_1_disk_normalised"] = (
            [
                x / b_norm
                for x in series(rows, lambda r: r["forge_sync"]["total_s"] / r["raw"]["write_s"])
            ]
            if b_norm
            else []
        )
        b_files = med(base["files_write_s"])
        out["files_vs_1"] = [x / b_files for x in out["files_write_s"]] if b_files else []
        b_load = med(base["load_s"])
        out["load_vs_1"] = [x / b_load for x in out["load_s"]] if b_load else []
    out["_rows"] = rows
    return out


def actor_summaries(actors: list[dict]) -> list[dict]:
    ordered = sorted(actors, key=lambda p: p["actors"])
    base = actor_summary(ordered[0], None) if ordered and ordered[0]["actors"] == 1 else None
    return [actor_summary(p, base) for p in ordered]


_COLUMNS = [
    "actors",
    "sync save / 1 actor",
    "same, disk-normalised",
    "save throughput / raw write",
    "sync save s",
    "async blocked s",
    "async to commit s",
    "load s",
    "load / 1 actor",
    "raw write s (1 file)",
    "raw write s (N files, N threads)",
    "same / 1 file",
    "Ray no-op call to all N ms",
    "poll slack ms",
]


def _row(s: dict) -> list[str]:
    return [
        str(s["actors"]),
        fmt(s.get("sync_vs_1", [])),
        fmt(s.get("sync_vs_1_disk_normalised", [])),
        fmt(s["sync_vs_raw"]),
        fmt(s["sync_s"], 3),
        fmt(s["async_blocked_s"], 3),
        fmt(s["async_total_s"], 3),
        fmt(s["load_s"], 3),
        fmt(s.get("load_vs_1", [])),
        fmt(s["raw_write_s"], 3),
        fmt(s["files_write_s"], 3),
        fmt(s.get("files_vs_1", [])),
        fmt([x * 1000 for x in s["ping_s"]], 0),
        fmt([x * 1000 for x in s["poll_slack_s"]], 0),
    ]


def scaling_section(actors: list[dict]) -> list[str]:
    """The actor-scaling table (one row per actor count)."""
    summ = actor_summaries(actors)
    md = [f"## Actor scaling ({summ[0]['bytes'] / MiB:.0f} MiB in all)\n"]
    md.append(table(_COLUMNS, [_row(s) for s in summ]))
    md.append("")
    pool = [(p["actors"], p.get("pool_start_s")) for p in actors if p.get("pool_start_s")]
    if pool:
        md.append(
            "Starting the actor processes (not part of any figure): "
            + ", ".join(f"{s:.0f}s to reach {n}" for n, s in pool)
            + ".\n"
        )
    return md


def _file_writes(last: dict, first: dict) -> tuple[list[float], list[float], list[float]]:
    """Per trial: the slowest and the median actor's file write at N, and the one actor's at 1."""
    writes = series(
        last["_rows"],
        lambda r: max(u["seconds"].get("file_write", 0.0) for u in r["forge_sync"]["units"]),
    )
    median_writes = series(
        last["_rows"],
        lambda r: statistics.median(
            u["seconds"].get("file_write", 0.0) for u in r["forge_sync"]["units"]
        ),
    )
    one_file = series(
        first["_rows"],
        lambda r: r["forge_sync"]["units"][0]["seconds"].get("file_write", 0.0),
    )
    return writes, median_writes, one_file


def scaling_analysis(results: dict, targets: dict) -> str:
    """'### Actor scaling' of 'Where the time goes'."""
    summ = actor_summaries(results["actors"])
    v = targets["actors_64_vs_1"]
    last, first = summ[-1], summ[0]
    n = last["actors"]
    writes, median_writes, one_file = _file_writes(last, first)
    fs_ratio = med(last.get("files_vs_1", [])) or 0.0
    ratio = med(v["values"]) or 0.0
    slack_n = med(last["poll_slack_s"]) or 0.0
    text = (
        f"{n} actors took {fmt(v['values'])} x the time of 1 actor for the same "
        f"{last['bytes'] / MiB:.0f} MiB ({met(v)}). "
    )
    text += (
        f"The file system is not what limits it: {n} files written and fsynced by {n} "
        if fs_ratio < ratio - 0.2
        else f"The file system's own cost grows too: {n} files written and fsynced by {n} "
    )
    text += (
        f"threads of one process took {fmt(last.get('files_vs_1', []))} x the time of one file. "
    )
    text += (
        f"What grows with N is the per-process, per-call work: a no-op Ray call to all {n} "
        f"actors took {1000 * (med(last['ping_s']) or 0):.0f} ms (vs "
        f"{1000 * (med(first['ping_s']) or 0):.0f} ms for {first['actors']}); inside each "
        f"actor, writing its {last['bytes'] / n / MiB:.0f} MiB file took "
        f"{secs(median_writes, 3)} at the median and {secs(writes, 3)} for the slowest, against "
        f"{secs(one_file, 3)} for {first['bytes'] / MiB:.0f} MiB in one actor: {n} actor "
        f"processes share {results['machine']['cores']} cores, so each waits for the CPU. "
        f"Between the last write and the commit the coordinator spent "
        f"{1000 * slack_n:.0f} ms at {n} actors "
        f"({1000 * (med(first['poll_slack_s']) or 0):.0f} ms at {first['actors']}). "
    )
    if slack_n > 0.01:
        text += (
            "That is one more round of calls to every actor (`forge_save_status`) after the "
            "round of `forge_begin_save` calls that already wrote the files; letting a "
            "synchronous `forge_begin_save` return its file records removes it. "
        )
    text += (
        "On a machine with a core per actor (Ray's normal placement) the per-actor work runs "
        "in parallel and the ratio approaches the file system's.\n"
    )
    return "### Actor scaling\n\n" + text
