"""Shared by every section of the report: constants, targets, statistics, markdown helpers.

Every ratio is computed per trial between measurements taken back to back (paired), then
summarised as the median with the min-max over trials. Seconds and MB/s are given for
reference only: they depend on the machine and on the moment.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

MiB = 1 << 20
MB = 1e6
REFERENCE_MIB = 1024  # the size at which the targets are judged (the largest below it if absent)

TARGETS = {
    "save_vs_raw": ("Full synchronous save throughput vs raw fsync'd write", ">=", 0.9),
    "async_blocked": ("Async: `save()` blocked time / synchronous save time", "<=", 0.05),
    "actors_64_vs_1": ("64 actors vs 1 actor, same total bytes (sync save time)", "<=", 1.5),
    "trainer_vs_titan": ("forge_ckpt trainer save / TorchTitan alone (same state)", "<=", 1.1),
    "load_vs_raw": ("Load throughput (cold cache) vs raw cold read", ">=", 0.9),
    "gpu_blocked": ("GPU: async `save()` blocking for 6 GiB on H100/H200 (seconds)", "<=", 0.5),
}


# ---- statistics -------------------------------------------------------------------------------


def get(row: dict, *keys: str) -> Any:
    cur: Any = row
    for k in keys:
        if not isinstance(cur, dict) or cur.get(k) is None:
            return None
        cur = cur[k]
    return cur


def series(rows: list[dict], fn: Callable[[dict], float | None]) -> list[float]:
    """fn applied to every trial; trials where a measurement failed (None, missing) are left out."""
    out = []
    for row in rows:
        try:
            v = fn(row)
        except (KeyError, TypeError, ZeroDivisionError):
            v = None
        if v is not None:
            out.append(float(v))
    return out


def gpu_machine(results: dict) -> dict:
    """The machine the GPU figures were measured on: this run's, or a merged GPU run's."""
    return results.get("gpu_run", {}).get("machine", results["machine"])


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def fmt(xs: list[float], digits: int = 2, unit: str = "") -> str:
    """'median (min-max)', or a single value, or '-' when nothing was measured."""
    if not xs:
        return "-"
    m = statistics.median(xs)
    if len(xs) == 1 or min(xs) == max(xs):
        return f"{m:.{digits}f}{unit}"
    return f"{m:.{digits}f}{unit} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def mbps(nbytes: Any, seconds: Any) -> float | None:
    if nbytes is None or not seconds:
        return None
    return nbytes / seconds / MB


# ---- markdown helpers ---------------------------------------------------------------------


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def met(v: dict) -> str:
    if v.get("met") is None:
        return "not measured"
    if v["met"]:
        return "**met**" + ("" if v.get("every_trial") else " (median; not in every trial)")
    return "**missed**"


def secs(xs: list[float], digits: int = 2) -> str:
    m = med(xs)
    return "-" if m is None else f"{m:.{digits}f}s"


def rounded(obj: Any) -> Any:
    """Floats to 0.1 ms / 4 decimals (keeps the JSON small; far below the noise)."""
    if isinstance(obj, float):
        return round(obj, 4)
    if isinstance(obj, dict):
        return {k: rounded(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded(v) for v in obj]
    return obj
