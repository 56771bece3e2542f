"""`python -m benchmarks.tiers`: the replicated memory tier (`mem://`, docs/tiers.md) against
the local disk and S3, on a real 3-node Ray cluster and a real SeaweedFS S3 server, both
started on loopback for the run (benchmarks/tiers/env.py).

    python -m benchmarks.tiers                      # 1024 MiB, 3 trials: writes
        docs/benchmarks_tiers.json and the tiers section of docs/benchmarks.md (~10 min)
    python -m benchmarks.tiers --quick              # 128 MiB, 1 trial, into runs/bench-tiers-quick/
    python -m benchmarks.tiers --mib 512 --trials 5 --parts saveload
    python -m benchmarks.tiers --report-only docs/benchmarks_tiers.json   # re-render the section

The parts (`PARTS`) run in order against the same cluster; each returns its trials and their
summary. A part whose `run` is None is planned and shows as "not measured yet" in the report:
adding one is writing its `run(env, mib, trials)` and its rows in report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import shlex
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .. import contention, disk, setup_logging
from . import recovery, report, saveload
from .env import Env, environment

log = logging.getLogger("benchmarks")
RAM_FACTOR = 9  # peak memory of a run, in units of the state (writer, 2 holders, stores, S3)


@dataclass(frozen=True)
class Part:
    """One measurement of the tiers report; `run` is None while it is only planned."""

    name: str
    title: str
    run: Callable[[Env, int, int], Awaitable[dict[str, Any]]] | None


PARTS: list[Part] = [
    Part("saveload", "save and load: memory tier vs local disk vs S3", saveload.run),
    Part("recovery", "recovery after a node loss: from memory vs from S3", recovery.run),
]
# The loop stall of the stall-free cut and the GRPO step-time overhead have their own modules
# (benchmarks/stall.py, benchmarks/grpo/overhead.py) and sections of docs/benchmarks.md.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tiers", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 128 MiB, 1 trial")
    p.add_argument("--mib", type=int, default=None, help="state size in MiB (default 1024)")
    p.add_argument("--trials", type=int, default=None, help="trials per figure (default 3)")
    names = [x.name for x in PARTS if x.run is not None]
    p.add_argument("--parts", nargs="+", choices=names, default=names, help="parts to run")
    p.add_argument("--work-dir", default="runs/bench-tiers", help="scratch folder (deleted)")
    p.add_argument("--out", help="report folder (default docs/, runs/bench-tiers-quick/ --quick)")
    p.add_argument("--report-only", metavar="JSON", help="render the section from a results file")
    args = p.parse_args(argv)
    args.mib = args.mib or (128 if args.quick else 1024)
    args.trials = args.trials or (1 if args.quick else 3)
    args.out = args.out or ("runs/bench-tiers-quick" if args.quick else "docs")
    if args.trials < 1 or args.mib < 1:
        p.error("--trials and --mib must be >= 1")
    return args


def _command(argv: list[str] | None) -> str:
    return "python -m benchmarks.tiers" + "".join(
        " " + shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )


def _new_results(args: argparse.Namespace, command: str, cache: str) -> dict[str, Any]:
    from ..run import machine_info

    return {
        "command": command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(args.work_dir),
        "cache_method": cache,
        "config": {"mib": args.mib, "trials": args.trials, "parts": args.parts},
        "planned": [{"name": x.name, "title": x.title} for x in PARTS if x.run is None],
        "parts": {},
        "errors": [],
    }


async def run_parts(env: Env, args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Every selected part in order; a failed part is reported and the next one still runs."""
    for part in PARTS:
        if part.run is None or part.name not in args.parts:
            continue
        t0 = time.perf_counter()
        log.info("part %s: %s", part.name, part.title)
        try:
            out = await part.run(env, args.mib, args.trials)
        except Exception as e:  # a wrong load, a node that did not come back: say so, go on
            log.exception("part %s failed", part.name)
            results["errors"].append(f"{part.name}: {type(e).__name__}: {e}")
            continue
        out["wall_s"] = time.perf_counter() - t0
        results["parts"][part.name] = out


def _check_memory(mib: int) -> None:
    need, avail = RAM_FACTOR * mib * disk.MiB, disk.mem_available()
    if avail and need > avail:
        log.warning("a %d MiB state needs ~%.1f GiB of RAM at peak; %.1f GiB are available",
                    mib, need / 2**30, avail / 2**30)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    if args.report_only:
        with open(args.report_only) as f:
            report.write(json.load(f), args.out)
        return 0
    _check_memory(args.mib)
    os.makedirs(args.work_dir, exist_ok=True)
    root = os.path.abspath(args.work_dir)
    cache = disk.drop_cache_method()
    results = _new_results(args, _command(argv), cache)
    load, start = contention.now(), time.perf_counter()
    try:
        with environment(root, args.mib * disk.MiB, cache) as env:
            asyncio.run(run_parts(env, args, results))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - start
    results["loadavg_end"] = os.getloadavg()[0]
    trials = [r["loadavg"] for p in results["parts"].values() for r in p.get("trials", [])]
    results["load"] = contention.record(load, trials)  # (the section's closing note)
    report.write(results, args.out)
    log.info("done in %.0fs; report in %s", results["wall_s"], args.out)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
