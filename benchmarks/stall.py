"""How long a checkpoint stalls an RL training loop: `python -m benchmarks.stall`.

One trainer rank (TorchTitan's AdamW containers behind forge_ckpt's TrainerCheckpointer, the
same model as the rest of `make bench`) holds `--mib` of state (weights + both AdamW moments).
One loop iteration is what an RL trainer does between two optimizer steps: `save(step)`, then
the rollout (the trainer is idle while the policy generates: `--rollout-s`, slept by the
driver), then a training step. The loop's stall is the time `save()` held the loop plus the
time the optimizer step waited for a deferred snapshot copy (`TrainerCheckpointer.stall_s`).

Each trial runs every mode once, in a shuffled order, on the same disk:
- sync: `save()` returns after the commit (the stall is the whole save: the baseline);
- deferred (the stall-free cut): `save()` returns once the snapshot calls are submitted, the
  copy runs during the rollout and the optimizer step waits only if it is unfinished.
Each save is waited for (`coord.wait()`) after its iteration, outside the measured window.
Writes docs/benchmarks_stall.json and the "stall" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import shutil
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
import torch  # noqa: E402

from forge_ckpt import CheckpointConfig, CheckpointCoordinator, spawn_trainer_ranks  # noqa: E402

from . import contention, disk, sections  # noqa: E402
from .trainer_rank import BenchTrainer  # noqa: E402

MODES = ("sync", "deferred")  # "async" is deprecated: it now means "deferred" (config.py)
EXPOSED = "deferred, no rollout"


class StallTrainer(BenchTrainer):
    """The benchmark's trainer rank, with the two readings this benchmark needs."""

    def stall_s(self) -> float:
        return self.checkpointer.stall_s

    def timed_step(self) -> float:
        t0 = time.perf_counter()
        self.train_step()
        return time.perf_counter() - t0


async def iteration(coord: CheckpointCoordinator, trainer: Any, step: int, rollout_s: float):
    """save -> rollout -> train step; the stall and how the step's time changed."""
    waited0 = await trainer.stall_s.remote()
    t0 = time.perf_counter()
    result = await coord.save(step)
    blocked = time.perf_counter() - t0
    await asyncio.sleep(rollout_s)
    train_s = await trainer.timed_step.remote()
    waited = await trainer.stall_s.remote() - waited0
    done = await coord.wait()
    total = (done or result).total_s
    return {"blocked_s": blocked, "step_wait_s": waited, "stall_s": blocked + waited,
            "save_total_s": total, "train_s": train_s}  # fmt: skip


async def measure(args: argparse.Namespace, root: str) -> dict[str, Any]:
    trainer = spawn_trainer_ranks(ray.remote(num_cpus=0)(StallTrainer), 1)[0]
    info = await trainer.setup.remote(args.mib * disk.MiB, "cpu")
    coords = {}
    for mode in MODES:
        folder = os.path.join(root, mode)
        coords[mode] = CheckpointCoordinator(
            CheckpointConfig(folder=folder, async_mode=mode, keep_last=1)
        )
        coords[mode].set_trainer([trainer])
        await coords[mode].save(0)  # warm: buffers allocated, threads and process group made
        await coords[mode].wait()
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    baseline: list[float] = []
    steps = itertools.count(1)  # step numbers only grow, in every folder
    for trial in range(args.trials):
        order = list(MODES)
        random.Random(trial).shuffle(order)
        for mode in order:
            rows[mode].append(await iteration(coords[mode], trainer, next(steps), args.rollout_s))
            baseline.append(await trainer.timed_step.remote())  # a step with no save around
        # the worst case: no rollout, the optimizer step follows save() at once
        exposed = await iteration(coords["deferred"], trainer, next(steps), 0.0)
        rows.setdefault(EXPOSED, []).append(exposed)
    for c in coords.values():
        await c.aclose()
    ray.kill(trainer)
    return {"state": info, "modes": rows, "train_s_no_save": baseline}


def summarise(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    med = {m: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
           for m, rows in raw["modes"].items()}  # fmt: skip
    sync_save = med["sync"]["save_total_s"]
    train = statistics.median(raw["train_s_no_save"])
    return {
        "mib": args.mib,
        "rollout_s": args.rollout_s,
        "trials": args.trials,
        "state_bytes": raw["state"]["tensor_bytes"],
        "median": med,
        "train_s_no_save": train,
        "stall_vs_sync_save": {m: med[m]["stall_s"] / sync_save for m in med},
        "train_step_slowdown": {m: med[m]["train_s"] / train for m in med},
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
        "command": f"python -m benchmarks.stall --mib {args.mib} --trials {args.trials} "
        f"--rollout-s {args.rollout_s}",
        "date": time.strftime("%Y-%m-%d"),
        "raw": raw,
    }


def markdown(res: dict[str, Any]) -> str:
    begin, end = sections.markers("stall")
    med, ratio = res["median"], res["stall_vs_sync_save"]
    gib = res["state_bytes"] / 2**30
    lines = [
        begin,
        "## Loop stall of a checkpoint: the stall-free cut",
        "",
        f"One trainer rank with {gib:.2f} GiB of state (weights + AdamW moments, fp32, CPU); "
        f"one iteration = `save(step)`, a rollout of {res['rollout_s']:.1f} s (trainer idle), "
        "a training step. Stall = time `save()` held the loop + time the optimizer step "
        f"waited for the snapshot copy. Medians of {res['trials']} trials, modes shuffled. "
        f"`{res['command']}` ({res['date']}, {res['machine']['cpus']} cores).",
        "",
        "| mode | save() held the loop | optimizer step waited | stall / sync save | "
        "train step vs no save |",
        "|---|---|---|---|---|",
    ]
    for m in med:
        lines.append(
            f"| {m} | {med[m]['blocked_s'] * 1e3:.1f} ms | {med[m]['step_wait_s'] * 1e3:.1f} ms "
            f"| **{ratio[m]:.3f}** | {res['train_step_slowdown'][m]:.2f}x |"
        )
    lines += [
        "",
        f"The synchronous save (the baseline) took {med['sync']['save_total_s']:.2f} s until "
        'committed. With `async_mode="deferred"` the loop pays only for submitting one call '
        "per component: the copy to host memory runs while the trainer waits for the rollout, "
        "and the optimizer step waits only when the rollout is shorter than the copy (the "
        f"*{EXPOSED}* row: the step follows `save()` at once; {_exposed(med[EXPOSED])}). "
        "What is left is what the copy and the write take from the training step: on this 2-core "
        'machine they share the cores with it ("train step vs no save"); on a GPU trainer '
        "the copy is a device-to-host transfer and the write uses otherwise idle host cores.",
        end,
    ]
    return "\n".join(lines)


def _exposed(row: dict[str, float]) -> str:
    wait = row["step_wait_s"]
    if wait < 0.5e-3:
        return "its forward and backward outlasted the copy, so the optimizer step did not wait"
    return f"the optimizer step waited {wait * 1e3:.0f} ms for the rest of the copy"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024, help="trainer state size (default 1024)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--rollout-s", type=float, default=2.0, help="the trainer's idle time")
    p.add_argument("--quick", action="store_true", help="64 MiB, 2 trials, report not written")
    args = p.parse_args(argv)
    if args.quick:
        args.mib, args.trials = 64, 2
    os.makedirs("runs", exist_ok=True)
    root = tempfile.mkdtemp(prefix="stall-", dir="runs")
    load = contention.now()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        res = summarise(asyncio.run(measure(args, root)), args)
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    res["load"] = contention.record(load)
    if not args.quick:
        sections.write_section("stall", markdown(res), res)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
