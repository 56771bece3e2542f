"""CPU time of every process on this machine, by kind, between two moments of a GRPO run.

The overhead benchmark's cluster and the app share this machine's cores: a checkpoint every
step costs the step what its CPU work takes from it. Reading each process's utime + stime
(`/proc/<pid>/stat`) when the app prints its first and its last progress line gives what
each kind of process spent per step in between, so that the one-time costs (Ray starting
the actors, the holders' processes) stay out of it.
"""

from __future__ import annotations

import os
from collections import Counter

HZ = os.sysconf("SC_CLK_TCK")
KINDS = (  # (kind, what its name or command line contains), first match wins
    ("memory holders", ("ray::Holder",)),
    ("trainer", ("ray::Trainer",)),
    ("Ray (raylets, GCS, workers idle)", ("raylet", "gcs_server", "ray::IDLE", "/ray/")),
    ("other actors (data, policy, replay, reward)", ("ray::",)),
    ("kernel (writeback, I/O)", ("kworker",)),
)


Sample = dict[tuple[int, int], tuple[str, float]]


def sample() -> Sample:
    """(pid, start time) -> (name and command line, CPU seconds so far) for every process. A
    kernel worker's name changes with its work item: a process is its pid and start time."""
    out: Sample = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read(300).replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        key = (int(pid), int(fields[19]))  # fields[19]: starttime, in clock ticks since boot
        out[key] = (f"{comm} {cmd}", (int(fields[11]) + int(fields[12])) / HZ)
    return out


def kind(name: str, driver_pid: int, pid: int) -> str:
    if pid == driver_pid:
        return "driver (the app's main process)"
    for label, needles in KINDS:
        if any(n in name for n in needles):
            return label
    return "other"


def spent(before: Sample, after: Sample, driver_pid: int) -> dict[str, float]:
    """CPU seconds by kind between two samples: a process started in between counts whole,
    one that ended in between is lost (the samples are taken while the app's processes all
    run). Everything on the machine is counted: the run must have it to itself."""
    out: Counter[str] = Counter()
    for key, (name, cpu) in after.items():
        was = before.get(key)
        base = was[1] if was is not None else 0.0
        if cpu > base:
            out[kind(name, driver_pid, key[0])] += cpu - base
    return dict(out)
