"""Disk and single-process baselines at each state size: the per-trial metrics, ratios and
seconds of a state point, and their three tables (ratios, MB/s, seconds)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .common import MiB, fmt, get, mbps, series, table

# ---- metrics of one state point ---------------------------------------------------------------


def _raw_write(r: dict) -> float | None:
    return mbps(get(r, "raw", "bytes"), get(r, "raw", "write_s"))


def _raw_read(r: dict) -> float | None:
    return mbps(get(r, "raw", "bytes"), get(r, "raw", "read_s"))


def _full_sync(r: dict) -> float | None:
    return mbps(get(r, "forge_full_sync", "bytes"), get(r, "forge_full_sync", "total_s"))


def _load(r: dict, key: str = "load") -> float | None:
    return mbps(get(r, "forge_full_sync", key, "bytes"), get(r, "forge_full_sync", key, "seconds"))


STATE_METRICS: dict[str, tuple[str, Callable[[dict], float | None]]] = {
    # name: (label, per-trial function)
    "raw_write_mbps": ("raw write + fsync, Python (MB/s)", _raw_write),
    "dd_mbps": (
        "dd bs=16M conv=fsync (MB/s)",
        lambda r: mbps(r["raw"]["dd_bytes"], r["raw"]["dd_s"]),
    ),
    "raw_read_mbps": ("raw cold read (MB/s)", _raw_read),
    "torch_save_mbps": (
        "torch.save + fsync, trainer (MB/s)",
        lambda r: mbps(r["torch_save"]["bytes"], r["torch_save"]["seconds"]),
    ),
    "titan_sync_mbps": (
        "TorchTitan dcp_save sync, trainer (MB/s)",
        lambda r: mbps(r["titan_sync"]["bytes"], r["titan_sync"]["total_s"]),
    ),
    "titan_load_mbps": (
        "TorchTitan dcp_load cold, trainer (MB/s)",
        lambda r: mbps(r["titan_sync"]["bytes"], r["titan_sync"]["load_s"]),
    ),
    "forge_trainer_mbps": (
        "forge_ckpt sync, trainer only (MB/s)",
        lambda r: mbps(r["forge_trainer_sync"]["bytes"], r["forge_trainer_sync"]["total_s"]),
    ),
    "forge_full_mbps": ("forge_ckpt sync, trainer + actors (MB/s)", _full_sync),
    "forge_async_total_mbps": (
        "forge_ckpt async until committed, trainer + actors (MB/s)",
        lambda r: mbps(r["forge_full_async"]["bytes"], r["forge_full_async"]["total_s"]),
    ),
    "forge_load_mbps": ("forge_ckpt load cold, verified (MB/s)", _load),
    "forge_load_noverify_mbps": (
        "forge_ckpt load cold, verify_on_load=False (MB/s)",
        lambda r: _load(r, "load_noverify"),
    ),
}

STATE_RATIOS: dict[str, tuple[str, Callable[[dict], float | None]]] = {
    "save_vs_raw": (
        "forge_ckpt full sync save throughput / raw write (higher is better)",
        lambda r: _full_sync(r) / _raw_write(r),
    ),
    "save_vs_dd": (
        "forge_ckpt full sync save throughput / dd",
        lambda r: _full_sync(r) / mbps(r["raw"]["dd_bytes"], r["raw"]["dd_s"]),
    ),
    "trainer_vs_titan": (
        "forge_ckpt trainer-only sync save time / TorchTitan sync (lower is better)",
        lambda r: r["forge_trainer_sync"]["total_s"] / r["titan_sync"]["total_s"],
    ),
    "titan_vs_raw": (
        "TorchTitan sync save throughput / raw write",
        lambda r: mbps(r["titan_sync"]["bytes"], r["titan_sync"]["total_s"]) / _raw_write(r),
    ),
    "torch_save_vs_raw": (
        "torch.save throughput / raw write",
        lambda r: mbps(r["torch_save"]["bytes"], r["torch_save"]["seconds"]) / _raw_write(r),
    ),
    "async_blocked": (
        "forge_ckpt async: save() blocked / sync save time (lower is better)",
        lambda r: r["forge_full_async"]["blocked_s"] / r["forge_full_sync"]["total_s"],
    ),
    "async_total": (
        "forge_ckpt async: time to commit / sync save time",
        lambda r: r["forge_full_async"]["total_s"] / r["forge_full_sync"]["total_s"],
    ),
    "trainer_async_vs_titan_async": (
        "forge_ckpt trainer-only async blocked / TorchTitan async blocked",
        lambda r: r["forge_trainer_async"]["blocked_s"] / r["titan_async"]["blocked_s"],
    ),
    "titan_async_blocked": (
        "TorchTitan async: dcp_save blocked / TorchTitan sync time",
        lambda r: r["titan_async"]["blocked_s"] / r["titan_sync"]["total_s"],
    ),
    "load_vs_raw": (
        "forge_ckpt load throughput (verified) / raw cold read (higher is better)",
        lambda r: _load(r) / _raw_read(r),
    ),
    "load_noverify_vs_raw": (
        "forge_ckpt load throughput (verify_on_load=False) / raw cold read",
        lambda r: _load(r, "load_noverify") / _raw_read(r),
    ),
    "load_vs_titan": (
        "forge_ckpt load throughput (verified, trainer + actors) / TorchTitan dcp_load throughput",
        lambda r: _load(r) / mbps(r["titan_sync"]["bytes"], r["titan_sync"]["load_s"]),
    ),
    "titan_load_vs_raw": (
        "TorchTitan dcp_load throughput / raw cold read",
        lambda r: mbps(r["titan_sync"]["bytes"], r["titan_sync"]["load_s"]) / _raw_read(r),
    ),
}

STATE_SECONDS: dict[str, tuple[str, Callable[[dict], float | None]]] = {
    "raw_write_s": ("raw write + fsync", lambda r: r["raw"]["write_s"]),
    "raw_read_s": ("raw cold read", lambda r: r["raw"]["read_s"]),
    "torch_save_s": ("torch.save + fsync (trainer)", lambda r: r["torch_save"]["seconds"]),
    "titan_sync_s": ("TorchTitan sync (trainer)", lambda r: r["titan_sync"]["total_s"]),
    "titan_async_blocked_s": (
        "TorchTitan async blocked (trainer)",
        lambda r: r["titan_async"]["blocked_s"],
    ),
    "titan_async_total_s": (
        "TorchTitan async total (trainer)",
        lambda r: r["titan_async"]["total_s"],
    ),
    "titan_load_s": ("TorchTitan load cold (trainer)", lambda r: r["titan_sync"]["load_s"]),
    "forge_trainer_sync_s": (
        "forge_ckpt sync (trainer only)",
        lambda r: r["forge_trainer_sync"]["total_s"],
    ),
    "forge_trainer_async_blocked_s": (
        "forge_ckpt async blocked (trainer only)",
        lambda r: r["forge_trainer_async"]["blocked_s"],
    ),
    "forge_full_sync_s": ("forge_ckpt sync (all)", lambda r: r["forge_full_sync"]["total_s"]),
    "forge_full_async_blocked_s": (
        "forge_ckpt async blocked (all)",
        lambda r: r["forge_full_async"]["blocked_s"],
    ),
    "forge_full_async_total_s": (
        "forge_ckpt async to commit (all)",
        lambda r: r["forge_full_async"]["total_s"],
    ),
    "forge_load_s": (
        "forge_ckpt load cold (all)",
        lambda r: r["forge_full_sync"]["load"]["seconds"],
    ),
    "forge_load_noverify_s": (
        "forge_ckpt load cold, no verify (all)",
        lambda r: r["forge_full_sync"]["load_noverify"]["seconds"],
    ),
}


def state_summary(point: dict) -> dict[str, Any]:
    rows = point["trials"]
    out: dict[str, Any] = {"total_mib": point["total_target"] // MiB}
    for group in (STATE_METRICS, STATE_RATIOS, STATE_SECONDS):
        for key, (_, fn) in group.items():
            out[key] = series(rows, fn)
    return out


def state_tables(states: list[dict], summaries: list[dict]) -> list[str]:
    """The ratio, throughput and seconds tables, one column per state size."""
    md: list[str] = []
    add = md.append
    add("## Save and load at each state size: ratios\n")
    header = ["Ratio"] + [f"{s['total_mib']} MiB" for s in summaries]
    rows = [[label] + [fmt(s[key]) for s in summaries] for key, (label, _) in STATE_RATIOS.items()]
    add(table(header, rows))
    add("")
    add("## Throughput (MB/s, reference)\n")
    rows = [
        [label] + [fmt(s[key], 0) for s in summaries] for key, (label, _) in STATE_METRICS.items()
    ]
    add(table(["MB/s"] + header[1:], rows))
    add("")
    add("## Seconds (reference)\n")
    rows = [
        [label] + [fmt(s[key], 3) for s in summaries] for key, (label, _) in STATE_SECONDS.items()
    ]
    rows.append(
        ["bytes written by one full step"] + [f"{p['full_bytes'] / MiB:.0f} MiB" for p in states]
    )
    add(table(["seconds"] + header[1:], rows))
    add("")
    return md
