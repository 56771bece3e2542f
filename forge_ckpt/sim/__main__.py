"""`python -m forge_ckpt.sim --seeds N` runs N schedules; `--seed S --trace` replays one."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys
import threading
import time

from .reverts import REVERTS
from .scenario import run_seed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m forge_ckpt.sim", description=__doc__)
    p.add_argument("--seeds", type=int, default=1000, help="how many schedules")
    p.add_argument("--first", type=int, default=0, help="the first seed")
    p.add_argument("--seed", type=int, help="replay this one seed")
    p.add_argument("--trace", action="store_true", help="print the event trace")
    p.add_argument("--verbose", action="store_true", help="name each seed as it starts")
    p.add_argument("--hang-s", type=float, default=60.0, help="a seed that runs longer hangs")
    p.add_argument("--revert", choices=sorted(REVERTS), help="take one fix back out first")
    p.add_argument("--stop-first", action="store_true", help="stop at the first violation")
    args = p.parse_args(argv)
    if os.environ.get("PYTHONHASHSEED") != "0":  # set order must not differ between runs
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        argv = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, "-m", "forge_ckpt.sim", *argv], env)
    logging.getLogger("forge_ckpt").setLevel(logging.INFO if args.trace else logging.CRITICAL)
    if args.revert:
        REVERTS[args.revert]()
    seeds = [args.seed] if args.seed is not None else range(args.first, args.first + args.seeds)
    start, failed = time.perf_counter(), 0
    for seed in seeds:
        # A schedule never waits for real time: one that hangs is a deadlock of real
        # threads (a lock held across a gate). Print where, with the seed, and stop.
        watchdog = threading.Timer(args.hang_s, _hung, (seed,))
        watchdog.daemon = True
        watchdog.start()
        print(f"seed {seed}", file=sys.stderr, flush=True) if args.verbose else None
        out = run_seed(seed)
        watchdog.cancel()
        if args.trace:
            print("\n".join(out.trace))
        if out.violation is not None:
            failed += 1
            print(f"seed {seed}: {out.violation}\n  replay: python -m forge_ckpt.sim --seed "
                  f"{seed} --trace")  # fmt: skip
            if failed >= 5 or args.stop_first:
                break
    n = len(seeds) if not failed or not args.stop_first else seeds.index(seed) + 1
    print(f"{n} schedules in {time.perf_counter() - start:.1f}s: {failed} violated an invariant")
    return 1 if failed else 0


def _hung(seed: int) -> None:
    print(f"seed {seed} hangs (a real lock held across a gate?): its stacks\n  replay: "
          f"python -m forge_ckpt.sim --seed {seed} --trace", flush=True)  # fmt: skip
    faulthandler.dump_traceback(all_threads=True)
    sys.stdout.flush()
    os._exit(2)


if __name__ == "__main__":
    sys.exit(main())
