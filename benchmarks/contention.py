"""Was a benchmark run taken on a busy machine? Load average at its start and end, and a flag.

The development machine has 2 cores shared by several jobs; a ratio of two methods measured
in the same trial stays fair under competing load (both pay it), but the bare MB/s and the
CPU-bound figures do not. Every benchmark records the 1-minute load average when it starts
(before its own work: other jobs only), at its end (its own work included) and, where it has
trials, at each trial's start; `flag` says 'competing load' when the start exceeded half the
cores or any reading exceeded 1.5x the cores (more than this benchmark's own threads make).
"""

from __future__ import annotations

import os
import time
from typing import Any


def now() -> float:
    return round(os.getloadavg()[0], 2)


def record(start: float, trials: list[float] | None = None) -> dict[str, Any]:
    """The load record of a run that began at load average `start` and ends now."""
    cores = os.cpu_count() or 1
    end = now()
    readings = [end, *(trials or [])]
    busy = start > 0.5 * cores or max(readings) > 1.5 * cores
    return {
        "loadavg_start": start,
        "loadavg_end": end,
        "loadavg_trials": list(trials or []),
        "cores": cores,
        "competing_load": busy,
    }


def note(rec: dict[str, Any] | None) -> str:
    """One markdown sentence for a report: the readings, and the flag when raised."""
    if not rec:
        return "Load average: not recorded (a run older than this field)."
    trials = rec.get("loadavg_trials") or []
    span = f", {min(trials):.1f}-{max(trials):.1f} at trial starts" if trials else ""
    text = (
        f"Load average {rec['loadavg_start']:.1f} at the start and {rec['loadavg_end']:.1f} "
        f"at the end{span} on {rec['cores']} cores."
    )
    if rec.get("competing_load"):
        text = (
            f"**Taken under competing load** (other jobs shared the cores): {text} The paired "
            "ratios compare methods measured in the same trial; bare rates and CPU figures are "
            "pessimistic."
        )
    return text


def settle(max_s: float = 240.0) -> float:
    """Wait (at most `max_s`) until the 1-minute load average is under half the cores: a
    part that follows another (the storage part after the Ray parts' 64 actors) otherwise
    starts on the last part's load and is flagged for it. Returns the seconds waited."""
    cores, start = os.cpu_count() or 1, time.monotonic()
    while os.getloadavg()[0] > 0.5 * cores and time.monotonic() - start < max_s:
        time.sleep(2.0)  # a benchmark's own pause between parts, not a test's wait
    return time.monotonic() - start


def machine_cpu_s() -> float:
    """CPU-seconds the whole machine has spent busy since boot (every process and the kernel:
    user, nice, system, irq, softirq, steal; not idle or iowait), from /proc/stat. The delta
    over a measurement says how much of the cores it kept busy, whichever processes did it."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
