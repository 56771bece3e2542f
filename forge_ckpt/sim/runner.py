"""Runs seeds, on every core: fixed blocks of consecutive seeds go to worker processes, and
the outcomes come back in seed order, so the output of a run does not depend on how many
workers ran it or which one ran what (each seed is hermetic: scenario._hermetic).

A seed that hangs (a real lock held across a gate: schedules never wait for real time) is
caught by a watchdog thread in the process that runs it, which prints the seed, its replay
command and the stacks, and ends that process.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any

from .scenario import run_seed

DEFAULT_SEEDS = 10_000  # the budget `make test` runs (tests/test_sim.py)
BLOCK = 20  # seeds per task: small enough that --stop-first stops soon after a violation


@dataclass(frozen=True)
class Result:
    seed: int
    violation: str | None
    trace: list[str] | None  # only when asked for


class Hung(RuntimeError):
    """A worker ended without answering: its seed hung (it printed which) or it was killed."""


def replay_line(seed: int) -> str:
    return f"  replay: python -m forge_ckpt.sim --seed {seed} --trace"


def default_jobs() -> int:
    """One worker per core this process may run on (at most 8: more gains nothing here)."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


class _Watchdog:
    """One thread per process, started once: a seed that runs longer than `hang_s` ends it."""

    current: tuple[int, float] | None = None  # (seed, when it started)
    _thread: threading.Thread | None = None

    @classmethod
    def start(cls, hang_s: float) -> None:
        if cls._thread is None:
            cls._thread = threading.Thread(target=cls._watch, args=(hang_s,), daemon=True)
            cls._thread.start()

    @classmethod
    def _watch(cls, hang_s: float) -> None:
        while True:
            time.sleep(min(1.0, hang_s / 4))
            cur = cls.current
            if cur is not None and time.monotonic() - cur[1] > hang_s:
                _hung(cur[0])


def _hung(seed: int) -> None:
    print(f"seed {seed} hangs (a real lock held across a gate?): its stacks\n"
          + replay_line(seed), flush=True)  # fmt: skip
    faulthandler.dump_traceback(all_threads=True)
    sys.stdout.flush()
    os._exit(2)


_STOP: Any = None  # in a worker: set once the caller needs no more results


def _start_worker(setup: Callable[[], None], stop: Any) -> None:
    global _STOP
    _STOP = stop
    setup()
    _fewer_collections()


def _fewer_collections() -> None:
    """The modules and whatever they built stay out of the cyclic collector's scans, which
    run ten times less often: about 4% of a schedule's time went to them. Schedules do not
    change (traces of seeds 0-399 byte-identical): what they keep alive is referenced, and
    refcounting frees the rest as before."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(7000, 10, 10)  # (700, 10, 10) by default


def run_block(seeds: range, hang_s: float, trace: bool, verbose: bool) -> list[Result]:
    """Run `seeds` in this process, in order, under the watchdog."""
    _Watchdog.start(hang_s)
    out = []
    for seed in seeds:
        if _STOP is not None and _STOP.is_set():
            break  # the caller stopped (a violation): what this block ran is not read
        print(f"seed {seed}", file=sys.stderr, flush=True) if verbose else None
        _Watchdog.current = (seed, time.monotonic())
        o = run_seed(seed)
        _Watchdog.current = None
        out.append(Result(seed, o.violation, o.trace if trace else None))
    return out


def results(
    seeds: range, jobs: int, hang_s: float, trace: bool, verbose: bool, setup: Callable[[], None]
) -> Generator[Result, None, None]:
    """Every seed's result, in seed order; `setup` runs first in each process (a revert).
    Closing the iterator early (a caller that stops at a violation) drops what is queued."""
    if jobs <= 1 or len(seeds) <= BLOCK:
        setup()
        _fewer_collections()
        for s in seeds:
            yield from run_block(range(s, s + 1), hang_s, trace, verbose)
        return
    blocks = [seeds[i : i + BLOCK] for i in range(0, len(seeds), BLOCK)]
    # fork: the workers start at once with the imports done; each runs `setup` itself.
    ctx = get_context("fork")
    stop = ctx.Event()
    pool = ProcessPoolExecutor(jobs, ctx, initializer=_start_worker, initargs=(setup, stop))
    try:
        futures: list[Future] = [pool.submit(run_block, b, hang_s, trace, verbose) for b in blocks]
        for fut in futures:
            try:
                yield from fut.result()
            except BrokenProcessPool as e:
                raise Hung("a worker ended without answering (see the hung seed above)") from e
    finally:
        stop.set()  # the blocks running end at their next seed; the queued ones never start
        pool.shutdown(wait=True, cancel_futures=True)
