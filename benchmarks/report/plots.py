"""The plots under docs/img/: throughput and blocked time vs state size, the trainer's save
phases against TorchTitan, actor scaling, and the storage part's MB/s bars."""

from __future__ import annotations

import os
import statistics
from typing import Any

from .baselines import STATE_METRICS, state_summary
from .common import MiB, med
from .phases import phases_summary
from .scaling import actor_summaries


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, img_dir: str, name: str) -> str:
    fig.tight_layout()
    path = os.path.join(img_dir, name)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _errorline(ax: Any, xs: list, series_list: list, label: str, style: str = "-o") -> None:
    pts = [(x, s) for x, s in zip(xs, series_list, strict=True) if s]
    if not pts:
        return
    x = [p[0] for p in pts]
    m = [statistics.median(p[1]) for p in pts]
    lo = [mm - min(p[1]) for mm, p in zip(m, pts, strict=True)]
    hi = [max(p[1]) - mm for mm, p in zip(m, pts, strict=True)]
    ax.errorbar(x, m, yerr=[lo, hi], fmt=style, capsize=3, label=label)


def _throughput(states: list[dict], img_dir: str) -> str:
    xs = [s["total_mib"] for s in states]
    fig, (ax1, ax2) = _pyplot().subplots(1, 2, figsize=(13, 5))
    for key, style in (
        ("raw_write_mbps", "-o"),
        ("dd_mbps", ":o"),
        ("torch_save_mbps", "--s"),
        ("titan_sync_mbps", "--^"),
        ("forge_trainer_mbps", "-^"),
        ("forge_full_mbps", "-D"),
        ("forge_async_total_mbps", "-.D"),
    ):
        _errorline(ax1, xs, [s[key] for s in states], STATE_METRICS[key][0], style)
    for key, style in (
        ("raw_read_mbps", "-o"),
        ("titan_load_mbps", "--^"),
        ("forge_load_mbps", "-D"),
        ("forge_load_noverify_mbps", "-.D"),
    ):
        _errorline(ax2, xs, [s[key] for s in states], STATE_METRICS[key][0], style)
    for ax, title in ((ax1, "Save throughput"), (ax2, "Load throughput (cold cache)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("total state (MiB)")
        ax.set_ylabel("MB/s (median, min-max)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_ylim(bottom=0)
    return _save(fig, img_dir, "throughput_vs_state.png")


def _blocked(states: list[dict], img_dir: str) -> str:
    fig, ax = _pyplot().subplots(figsize=(11, 5))
    bars = [
        ("forge_full_sync_s", "forge sync (all)"),
        ("forge_full_async_blocked_s", "forge async: blocked"),
        ("forge_full_async_total_s", "forge async: to commit"),
        ("forge_trainer_async_blocked_s", "forge async blocked (trainer only)"),
        ("titan_sync_s", "TorchTitan sync (trainer)"),
        ("titan_async_blocked_s", "TorchTitan async: blocked"),
        ("titan_async_total_s", "TorchTitan async: total"),
    ]
    width = 0.8 / len(bars)
    for i, (key, label) in enumerate(bars):
        ms = [med(s[key]) or 0.0 for s in states]
        lo = [m - min(s[key]) if s[key] else 0 for m, s in zip(ms, states, strict=True)]
        hi = [max(s[key]) - m if s[key] else 0 for m, s in zip(ms, states, strict=True)]
        pos = [j + (i - len(bars) / 2 + 0.5) * width for j in range(len(states))]
        ax.bar(pos, ms, width, yerr=[lo, hi], capsize=2, label=label)
    ax.set_xticks(range(len(states)), [f"{s['total_mib']} MiB" for s in states])
    ax.set_ylabel("seconds (median, min-max)")
    ax.set_title("Blocked vs total time, sync and async")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, img_dir, "blocked_vs_total.png")


def _trainer_phases(points: list[dict], xs: list[int], img_dir: str) -> str:
    phase_rows = [phases_summary(p) for p in points]
    parts = [
        ("t_dcp_save", "DCP write (dcp.save)"),
        ("t_crc_readback", "crc32c read-back of DCP files"),
        ("t_rank_file", "rank file"),
        ("t_fsync_dir", "folder fsyncs"),
        ("t_commit", "commit (manifest, marker)"),
    ]
    fig, ax = _pyplot().subplots(figsize=(9, 5))
    bottom = [0.0] * len(phase_rows)
    for key, label in parts:
        vals = [med(p[key]) or 0.0 for p in phase_rows]
        ax.bar(range(len(phase_rows)), vals, 0.35, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    titan = [med(p["titan_sync_s"]) or 0.0 for p in phase_rows]
    ax.bar(
        [i + 0.4 for i in range(len(phase_rows))],
        titan,
        0.35,
        label="TorchTitan dcp_save alone",
        color="grey",
    )
    ax.set_xticks([i + 0.2 for i in range(len(phase_rows))], [f"{x} MiB" for x in xs], fontsize=8)
    ax.set_ylabel("seconds (median)")
    ax.set_title("Trainer-only sync save: where the time goes (left) vs TorchTitan (right)")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, img_dir, "trainer_save_phases.png")


def _actors(actors: list[dict], img_dir: str) -> str:
    summ = actor_summaries(actors)
    xs = [s["actors"] for s in summ]
    fig, ax = _pyplot().subplots(figsize=(8, 5))
    for key, label, style in (
        ("sync_s", "sync save", "-o"),
        ("async_blocked_s", "async: save() blocked", "-s"),
        ("async_total_s", "async: to commit", "--s"),
        ("load_s", "load (cold)", "-^"),
        ("raw_write_s", "raw write of the same bytes (1 file)", ":o"),
        ("files_write_s", "raw write, N files by N threads", ":s"),
        ("raw_read_s", "raw cold read of the same bytes", ":^"),
    ):
        _errorline(ax, xs, [s[key] for s in summ], label, style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("actors (same total bytes)")
    ax.set_ylabel("seconds (median, min-max)")
    ax.set_title(f"Actor scaling, {summ[0]['bytes'] / MiB:.0f} MiB in all")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_ylim(bottom=0)
    return _save(fig, img_dir, "time_vs_actors.png")


def plots(results: dict, img_dir: str) -> list[str]:
    """The plots of the state sweep and the actor scaling; returns their paths."""
    os.makedirs(img_dir, exist_ok=True)
    made = []
    states = [state_summary(p) for p in results.get("state", [])]
    if states:
        made.append(_throughput(states, img_dir))
        made.append(_blocked(states, img_dir))
        xs = [s["total_mib"] for s in states]
        made.append(_trainer_phases(results["state"], xs, img_dir))
    if results.get("actors"):
        made.append(_actors(results["actors"], img_dir))
    return made


def storage_plot(rows: list[tuple[str, str, list[float]]], img_dir: str) -> str:
    """MB/s bars (median, min-max) of the storage part: (panel, method, values) per bar; one
    panel per medium (S3, local disk), side by side."""
    os.makedirs(img_dir, exist_ok=True)
    panels = list(dict.fromkeys(p for p, _, _ in rows))
    fig, axes = _pyplot().subplots(1, len(panels), figsize=(6.5 * len(panels), 5), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        bars = [(label, xs) for p, label, xs in rows if p == panel]
        ms = [med(xs) or 0.0 for _, xs in bars]
        lo = [m - min(xs) if xs else 0 for m, (_, xs) in zip(ms, bars, strict=True)]
        hi = [max(xs) - m if xs else 0 for m, (_, xs) in zip(ms, bars, strict=True)]
        colors = ["tab:blue" if "forge" in label else "tab:grey" for label, _ in bars]
        ax.barh(range(len(bars)), ms, xerr=[lo, hi], capsize=3, color=colors)
        ax.set_yticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("MB/s (median, min-max)")
        ax.set_title(panel)
        ax.grid(axis="x", alpha=0.3)
    return _save(fig, img_dir, "storage_throughput.png")
