"""Entry point of `python -m benchmarks.async_rl` (see the package docstring)."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

from forge_ckpt import CheckpointConfig, CheckpointCoordinator  # noqa: E402

from .. import sections  # noqa: E402
from .workload import Workload  # noqa: E402


async def trial(w: Workload, coord: CheckpointCoordinator, step: int, drain: bool) -> dict:
    """Submit a batch, wait until it is half decoded, then checkpoint (cut or drain)."""
    await w.submit_batch()
    await w.wait_tokens(w.batch_tokens // 2)
    inflight = await w.in_flight()
    t0 = time.perf_counter()
    if drain:
        await w.wait_idle()
    t1 = time.perf_counter()
    await coord.save(step)  # async mode: returns once every snapshot is taken
    t2 = time.perf_counter()
    await coord.wait()  # the commit, while the loop would go on
    t3 = time.perf_counter()
    await w.wait_idle()  # let the batch finish before the next trial (not measured)
    await w.collect()
    return {
        "mode": "drain" if drain else "cut",
        "step": step,
        "stall_s": t2 - t0,
        "save_to_commit_s": t3 - t0,
        "drain_wait_s": t1 - t0,
        "requests_in_flight": len(inflight),
        "partial_tokens": sum(n for *_, n in inflight),
    }


async def measure_async(root: str, args: argparse.Namespace) -> dict[str, Any]:
    w = Workload(args)
    await w.start()
    folder = os.path.join(root, "ckpt")
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder, async_mode="async"))
    coord.register("generators", w.generators)
    rows = []
    for i in range(args.trials * 2):
        rows.append(await trial(w, coord, i + 1, drain=bool(i % 2)))
    coord.close()
    last_cut = max(r["step"] for r in rows if r["mode"] == "cut")
    resume = await w.resume_counts(os.path.join(root, "ckpt"), last_cut)
    return summarize(rows, resume, args)


def summarize(rows: list[dict], resume: dict, args: argparse.Namespace) -> dict[str, Any]:
    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["mode"] == mode)

    cut, drain = med("cut", "stall_s"), med("drain", "stall_s")
    return {
        **sections.stamp("python -m benchmarks.async_rl " + " ".join(sys.argv[1:])),
        "config": vars(args),
        "trials": rows,
        "cut_stall_s": cut,
        "drain_stall_s": drain,
        "stall_ratio": cut / drain,
        "cut_save_to_commit_s": med("cut", "save_to_commit_s"),
        "drain_save_to_commit_s": med("drain", "save_to_commit_s"),
        "drain_wait_s": med("drain", "drain_wait_s"),
        "resume": resume,
    }


def markdown(res: dict[str, Any]) -> str:
    begin, end = sections.markers("async_rl")
    r = res["resume"]
    ok_stall = "met" if res["stall_ratio"] <= 0.05 else "NOT met"
    ok_tokens = "met" if r["regenerated_tokens_cut"] == 0 else "NOT met"
    return f"""{begin}
## Asynchronous RL: the no-drain cut against draining

`{res["command"].strip()}` ({res["date"]}, {res["cpus"]} CPUs; [async_rl.md](async_rl.md)).
{res["config"]["replicas"]} generator replicas decode {res["config"]["requests"]} requests of
varied length at once; a checkpoint is taken mid-generation, alternately **cut** (forge_ckpt:
save at once, the generators snapshot between two tokens and keep decoding) and **drained**
(wait for every in-flight generation, then save), in the same run. Medians over
{res["config"]["trials"]} trials each, `async_mode="async"` saves: the stall lasts until
`save()` returns (every snapshot taken; for the drain, plus the wait), save-to-commit until the
COMMIT is durable. The drain's stall grows with the generations' length (here
{res["drain_wait_s"]:.2f} s of waiting, {res["config"]["token_cost_ms"]} ms per token); the
cut's does not depend on it.

| | cut | drain | cut / drain |
|---|---|---|---|
| loop stall (s) | {res["cut_stall_s"]:.3f} | {res["drain_stall_s"]:.3f} | **{res["stall_ratio"]:.3f}** |
| save() to committed (s) | {res["cut_save_to_commit_s"]:.3f} | {res["drain_save_to_commit_s"]:.3f} | |

Resume of the last cut step into fresh generators: {r["requests_in_flight"]} requests were in
flight with {r["partial_tokens"]} tokens decoded; finishing them decoded
{r["decoded_after_resume"]} tokens for the {r["tokens_still_missing"]} they lacked:
**{r["regenerated_tokens_cut"]} tokens regenerated** (the discard approach regenerates
{r["regenerated_tokens_discard"]}); completions equal to the uninterrupted ones:
{r["completions_equal"]}.

Targets: stall <= 5% of the drain's: **{ok_stall}**; 0 tokens regenerated after resume:
**{ok_tokens}**.
{end}"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the no-drain cut of async RL against draining")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--requests", type=int, default=32, help="requests per batch (all replicas)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--token-cost-ms", type=float, default=16.0, help="models a larger policy")
    p.add_argument("--quick", action="store_true", help="2 trials, results not written")
    args = p.parse_args(argv)
    if args.quick:
        args.trials = 2
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        measure = lambda root: asyncio.run(measure_async(root, args))  # noqa: E731
        sections.measure_and_write("async_rl", measure, markdown, write=not args.quick)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
