"""Medians and paired ratios over trials, shared by the parts of `python -m benchmarks.tiers`."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from typing import Any


class VerifyError(AssertionError):
    """A load restored something else than what was saved: the measurement is worthless."""


def spread(values: Iterable[float]) -> dict[str, float]:
    """Median and min-max of one figure over the trials."""
    vals = list(values)
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def paired(rows: list[dict[str, Any]], fn: Callable[[dict[str, Any]], float]) -> dict[str, float]:
    """A ratio taken inside each trial (neighbours in time), then its median over trials."""
    return spread(fn(r) for r in rows)


def check(what: str, got: Any, want: Any) -> None:
    """Raise VerifyError naming the load when `got` differs from `want`."""
    if got != want:
        raise VerifyError(f"{what}: loaded {str(got)[:120]!r}, saved {str(want)[:120]!r}")
