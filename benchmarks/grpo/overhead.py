"""What saving every step to the memory tier costs the GRPO app: `python -m benchmarks.grpo.overhead`.

The real app (`python -m apps.grpo.main --config configs/grpo.yaml`) runs on a real 3-node
cluster on this machine (benchmarks/tiers/env.py), its actors spread over the nodes, once per
variant per trial, variants in a shuffled order:
- `off`: no memory tier (`checkpoint.memory=false`), durable only at the last step: the
  baseline;
- `memory, sync`: every step saved to memory (2 copies on other nodes), `save()` returns after
  the memory commit;
- `memory, deferred`: the same with the stall-free cut (`checkpoint.async_mode=deferred`).
The app prints the median time between two steps' lines (one step plus the save before it);
the overhead is that median against the baseline's in the same trial. The durable folder is
local (`checkpoint.interval` = `steps`: one durable save, at the end, in every variant).
Writes docs/benchmarks_grpo.json and the "grpo" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
from typing import Any

from .. import disk, sections
from ..tiers.env import environment
from . import cpu

VARIANTS = {
    "off": ["checkpoint.memory=false"],
    "memory, sync": ["checkpoint.memory=true", "checkpoint.async_mode=sync"],
    "memory, deferred": ["checkpoint.memory=true", "checkpoint.async_mode=deferred"],
}
STEP_TIME = re.compile(r"step time: median ([0-9.]+) ms over (\d+) steps")
PROGRESS = re.compile(r"step\s+(\d+)/\d+ ")  # the app's plain progress line (every 10 steps)


def run_app(address: str, root: str, variant: str, steps: int) -> tuple[float, dict, dict]:
    """One run of the app: its median step time in seconds, and the CPU seconds per step each
    kind of process spent between its first progress line and its last but one, and the
    seconds per step its threads waited for a CPU (`cpu.py`)."""
    run_dir = os.path.join(root, re.sub(r"\W+", "-", variant))
    overrides = [
        f"ray.address={address}",
        "ray.placement=spread",
        f"run_dir={run_dir}",
        "fresh=true",
        f"steps={steps}",
        f"checkpoint.interval={steps}",
        *VARIANTS[variant],
    ]
    cmd = [sys.executable, "-m", "apps.grpo.main", "--config", "configs/grpo.yaml", *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks: list[tuple[int, cpu.Sample]] = []  # (step, CPU sample) at each progress line
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        at = PROGRESS.match(line)
        if at is not None:
            marks.append((int(at.group(1)), cpu.sample()))
    proc.wait(timeout=900)
    out = "".join(lines)
    found = STEP_TIME.search(out)
    if proc.returncode != 0 or found is None or len(marks) < 2:
        raise RuntimeError(f"{variant}: exit {proc.returncode}\n{out[-4000:]}")
    shutil.rmtree(run_dir, ignore_errors=True)
    # From the first line to the last before the final step's (which follows the run's one
    # durable save): every step in between saves to memory only.
    (first, before), (last, after) = marks[0], (marks[:-1] if len(marks) > 2 else marks)[-1]
    per_step = {k: v / (last - first) for k, v in cpu.spent(before, after, proc.pid).items()}
    waits = cpu.spent(before, after, proc.pid, field=2)
    return float(found.group(1)) / 1e3, per_step, {k: v / (last - first) for k, v in waits.items()}


def measure(args: argparse.Namespace, root: str) -> dict[str, Any]:
    rows: list[dict[str, float]] = []
    cpu_rows: list[dict[str, dict[str, float]]] = []
    wait_rows: list[dict[str, dict[str, float]]] = []
    with environment(root, 64 * disk.MiB, "none") as env:
        for trial in range(args.trials):
            order = list(VARIANTS)
            random.Random(trial).shuffle(order)
            runs = {v: run_app(env.cluster.address, root, v, args.steps) for v in order}
            row = {v: step for v, (step, _, _) in runs.items()}
            print(f"trial {trial + 1}: " + ", ".join(f"{v} {s * 1e3:.1f} ms" for v, s in row.items()),
                  flush=True)  # fmt: skip
            rows.append(row)
            cpu_rows.append({v: per_step for v, (_, per_step, _) in runs.items()})
            wait_rows.append({v: waits for v, (_, _, waits) in runs.items()})
    med = {v: statistics.median(r[v] for r in rows) for v in VARIANTS}
    overhead = {v: statistics.median(r[v] / r["off"] - 1 for r in rows) for v in VARIANTS}
    cpu_med, wait_med = _medians(cpu_rows), _medians(wait_rows)
    return {
        "steps": args.steps,
        "trials": args.trials,
        "median_step_s": med,
        "overhead": overhead,
        "rows": rows,
        "cpu_per_step_s": cpu_med,
        "cpu_rows": cpu_rows,
        "wait_per_step_s": wait_med,
        "wait_rows": wait_rows,
        **sections.stamp(
            f"python -m benchmarks.grpo.overhead --steps {args.steps} --trials {args.trials}"
        ),
    }


def _medians(rows: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per variant and kind of process, the median over trials."""
    kinds = sorted({k for r in rows for v in r.values() for k in v})
    return {v: {k: statistics.median(r[v].get(k, 0.0) for r in rows) for k in kinds}
            for v in VARIANTS}  # fmt: skip


def markdown(res: dict[str, Any]) -> str:
    begin, end = sections.markers("grpo")
    lines = [
        begin,
        "## GRPO step time with a memory checkpoint every step",
        "",
        f"`configs/grpo.yaml` on a 3-node cluster on this machine ({res['cpus']} cores), "
        f"actors spread over the nodes, {res['steps']} steps per run; median time between "
        f"two steps' lines (a step plus the save before it); {res['trials']} trials, variants "
        f"shuffled; overhead = median over trials of (variant / off - 1) in the same trial. "
        f"`{res['command']}` ({res['date']}).",
        "",
        "| variant | median step | overhead vs off |",
        "|---|---|---|",
    ]
    for v in VARIANTS:
        over = "baseline" if v == "off" else f"**{res['overhead'][v] * 100:+.1f}%**"
        lines.append(f"| {v} | {res['median_step_s'][v] * 1e3:.1f} ms | {over} |")
    lines += ["", *_tables(res), "", *_verdict(res), end]
    return "\n".join(lines)


def _kind_table(res: dict[str, Any], key: str, what: str, intro: str) -> list[str]:
    """Milliseconds per step by kind of process (`cpu.py`), median over trials."""
    med = res.get(key)
    if not med:
        return []
    kinds = sorted(med["off"], key=lambda k: -max(med[v].get(k, 0.0) for v in VARIANTS))
    out = [intro, "", f"| {what} | " + " | ".join(VARIANTS) + " |"]
    out.append("|---" * (len(VARIANTS) + 1) + "|")
    for k in [k for k in kinds if max(med[v].get(k, 0.0) for v in VARIANTS) >= 0.0005]:
        out.append(
            f"| {k} | " + " | ".join(f"{med[v].get(k, 0.0) * 1e3:.0f}" for v in VARIANTS) + " |"
        )
    total = {v: sum(med[v].values()) for v in VARIANTS}
    out.append("| **all** | " + " | ".join(f"**{total[v] * 1e3:.0f}**" for v in VARIANTS) + " |")
    return out


def _tables(res: dict[str, Any]) -> list[str]:
    cpu_intro = (
        f"CPU time per step, each process kind, between the app's first and last progress "
        f"lines but one (steps 10 to {res['steps'] - 10}: Ray starting the actors and the "
        "holders, and the last step's durable save, are left out), from `/proc/<pid>/stat` "
        f"(`benchmarks/grpo/cpu.py`); {res['cpus']} cores give 2000 CPU ms per second."
    )
    wait_intro = (
        "Time per step the threads of each process kind spent runnable but waiting for a CPU "
        "(run-queue wait, `/proc/<pid>/task/*/schedstat`, same interval; threads that ended "
        "in between are not counted): what the others' CPU work cost each kind."
    )
    cpu = _kind_table(res, "cpu_per_step_s", "CPU ms per step (all cores)", cpu_intro)
    wait = _kind_table(res, "wait_per_step_s", "run-queue wait, ms per step", wait_intro)
    return [*cpu, *([""] + wait if wait else [])]


STEP_KINDS = ("driver (the app's main process)", "other actors (data, policy, replay, reward)")


def _verdict(res: dict[str, Any]) -> list[str]:
    over = res["overhead"]["memory, deferred"]
    cpu_med = res.get("cpu_per_step_s") or {}
    extra = ""
    if cpu_med:
        on, off = cpu_med["memory, deferred"], cpu_med["off"]
        added = {k: on[k] - off.get(k, 0.0) for k in on}
        top = sorted((k for k in added if added[k] > 0), key=lambda k: -added[k])[:3]
        parts = ", ".join(f"{k} {added[k] * 1e3:.0f} ms" for k in top)
        extra = (
            f" A memory save every step adds {sum(added.values()) * 1e3:.0f} CPU ms per "
            f"step to a {res['median_step_s']['off'] * 1e3:.0f} ms step on {res['cpus']} "
            f"cores; most of it: {parts}. The trainer's share is its DCP write of the "
            "TorchTitan state: hundreds of small items, each tensor through `torch.save` "
            "(a one-rank trainer skips DCP's collectives; the next section measures one save "
            "alone)."
        )
    waits = res.get("wait_per_step_s") or {}
    if waits:
        more = {k: waits["memory, deferred"].get(k, 0.0) - waits["off"].get(k, 0.0)
                for k in (*STEP_KINDS, "trainer")}  # fmt: skip
        longer = res["median_step_s"]["memory, deferred"] - res["median_step_s"]["off"]
        extra += (
            f" The step is {longer * 1e3:.0f} ms longer with deferred saves; the threads of "
            f"the driver and the other actors (the policy's generation among them) waited for "
            f"a CPU {sum(more[k] for k in STEP_KINDS) * 1e3:.0f} ms more per step, and the "
            f"trainer's {more['trainer'] * 1e3:.0f} ms more (its save's own thread among "
            "them). That is summed over threads that wait side by side (Ray's own threads in "
            "each process among them): it shows the contention, not the step's added time. "
            "`save()` itself blocks a few ms (next section)."
        )
    verdict = "**Met**" if over <= 0.15 else "**Missed** on this machine (target: deferred <= +15%)"
    return [
        f"{verdict}.{extra} Deferred mode runs the save beside the next step, so what it "
        "costs the step is the CPU it takes from it: here the job, three raylets and the "
        "holders share the same cores, and this toy step lasts about a tenth of a second. On "
        "a cluster the holders run on other machines' cores and a GRPO step (generation) "
        "takes seconds. Lowering the save threads' priority does not help here: Ray runs its "
        "worker processes at nice 15, and write threads at nice 19 or `SCHED_IDLE` left the "
        "step's run-queue wait unchanged (tried 2026-11-28). What would meet the target here: "
        "cores that the save's work does not share with the step.",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="12 steps, 1 trial, report not written")
    p.add_argument("--report-only", metavar="JSON", help="render the section from a results file")
    args = p.parse_args(argv)
    if args.report_only:
        with open(args.report_only) as f:
            res = json.load(f)
        sections.write_section("grpo", markdown(res), res)
        return 0
    if args.quick:
        args.steps, args.trials = 12, 1
    sections.measure_and_write("grpo", lambda root: measure(args, root), markdown,
                               write=not args.quick)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
