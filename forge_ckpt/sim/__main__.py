"""`python -m forge_ckpt.sim --seeds N` runs N schedules; `--seed S --trace` replays one."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time

from .reverts import REVERTS
from .runner import DEFAULT_SEEDS, Hung, default_jobs, replay_line, results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m forge_ckpt.sim", description=__doc__)
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="how many schedules")
    p.add_argument("--first", type=int, default=0, help="the first seed")
    p.add_argument("--seed", type=int, help="replay this one seed")
    p.add_argument("--trace", action="store_true", help="print the event trace")
    p.add_argument("--verbose", action="store_true", help="name each seed as it starts")
    p.add_argument("--hang-s", type=float, default=60.0, help="a seed that runs longer hangs")
    p.add_argument("--revert", choices=sorted(REVERTS), help="take one fix back out first")
    p.add_argument("--stop-first", action="store_true", help="stop at the first violation")
    p.add_argument("--jobs", type=int, default=default_jobs(),
                   help="worker processes (default: one per core, at most 8)")  # fmt: skip
    args = p.parse_args(argv)
    if os.environ.get("PYTHONHASHSEED") != "0":  # set order must not differ between runs
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        argv = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, "-m", "forge_ckpt.sim", *argv], env)
    seeds = range(args.seed, args.seed + 1) if args.seed is not None else (
        range(args.first, args.first + args.seeds))  # fmt: skip
    setup = functools.partial(_setup, args.revert, args.trace)
    start, failed, n = time.perf_counter(), 0, 0
    out = results(seeds, args.jobs, args.hang_s, args.trace, args.verbose, setup)
    try:
        for res in out:
            n += 1
            if res.trace is not None:
                print("\n".join(res.trace))
            if res.violation is not None:
                failed += 1
                print(f"seed {res.seed}: {res.violation}\n{replay_line(res.seed)}", flush=True)
                if failed >= 5 or args.stop_first:
                    break
    except Hung as e:
        print(e, flush=True)
        return 2
    finally:
        out.close()
    took = time.perf_counter() - start
    print(f"{n} schedules in {took:.1f}s ({args.jobs} jobs): {failed} violated an invariant")
    return 1 if failed else 0


def _setup(revert: str | None, trace: bool) -> None:
    """In each process that runs seeds: the log level, and the fix taken out, if any."""
    logging.getLogger("forge_ckpt").setLevel(logging.INFO if trace else logging.CRITICAL)
    if revert:
        REVERTS[revert]()


if __name__ == "__main__":
    sys.exit(main())
