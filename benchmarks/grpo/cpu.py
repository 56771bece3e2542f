"""CPU time of every process on this machine, by kind, between two moments of a GRPO run,
and the time its threads waited for a CPU.

The overhead benchmark's cluster and the app share this machine's cores: a checkpoint every
step costs the step what its CPU work takes from it. Reading each process's utime + stime
(`/proc/<pid>/stat`) when the app prints its first and its last progress line gives what
each kind of process spent per step in between, so that the one-time costs (Ray starting
the actors, the holders' processes) stay out of it. The time its threads spent runnable but
waiting on a run queue (`/proc/<pid>/task/*/schedstat`, the second field) is what the CPU
work of others cost it: for the step's own processes, time added to the step.
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


Sample = dict[tuple[int, int], tuple[str, float, float]]  # name, CPU s, run-queue wait s


def sample() -> Sample:
    """(pid, start time) -> (name and command line, CPU seconds so far, seconds its live
    threads waited on a run queue) for every process. A kernel worker's name changes with
    its work item: a process is its pid and start time."""
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
        out[key] = (f"{comm} {cmd}", (int(fields[11]) + int(fields[12])) / HZ, _waited(pid))
    return out


def _waited(pid: str) -> float:
    """Seconds the process's live threads have waited on a run queue (schedstat's field 2)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # ended meanwhile, or no schedstats
            continue
    return total / 1e9


def kind(name: str, driver_pid: int, pid: int) -> str:
    if pid == driver_pid:
        return "driver (the app's main process)"
    for label, needles in KINDS:
        if any(n in name for n in needles):
            return label
    return "other"


def spent(before: Sample, after: Sample, driver_pid: int, field: int = 1) -> dict[str, float]:
    """CPU seconds (`field` 1; 2: run-queue wait) by kind between two samples: a process
    started in between counts whole, one that ended in between is lost (the samples are
    taken while the app's processes all run). Everything on the machine is counted: the run
    must have it to itself."""
    out: Counter[str] = Counter()
    for key, now in after.items():
        was = before.get(key)
        base = was[field] if was is not None else 0.0
        if now[field] > base:
            out[kind(now[0], driver_pid, key[0])] += now[field] - base
    return dict(out)
