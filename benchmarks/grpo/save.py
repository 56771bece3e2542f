"""What one checkpoint of the GRPO app's trainer costs: `python -m benchmarks.grpo.save`.

The app's own `Trainer` (configs/grpo.yaml: TorchTitan AdamW and LR containers, the small
policy) runs as one rank on a worker node of a real 3-node cluster (benchmarks/tiers/env.py).
Between two saves it takes an optimizer step on random gradients, so every save writes new
weights and moments. Three targets, in the same run, each `--saves` times after two warm-ups:
- `local disk`: a coordinator on a local folder (no memory tier), sync: the baseline;
- `memory, sync`: every save to the memory tier (2 copies on the other nodes);
- `memory, deferred`: the same with the stall-free cut; `blocked` is what `save()` held the
  caller, `save` is until the memory commit (`wait()`).
This is the trainer's share of what benchmarks/grpo/overhead.py measures in the whole app
(there, the four actors and the step itself run too). Writes docs/benchmarks_grpo_save.json
and the "grpo_save" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

import ray
import torch
import yaml

from apps.grpo.trainer import Trainer
from forge_ckpt import CheckpointConfig, CheckpointCoordinator, spawn_trainer_ranks

from .. import disk, sections
from ..tiers.env import environment, on

VARIANTS = {"local disk": ("local", "sync"), "memory, sync": ("memory", "sync"),
            "memory, deferred": ("memory", "deferred")}  # fmt: skip


def _optimizer_step(self: Any) -> None:
    """Runs in the trainer actor: a step on random gradients (no data needed)."""
    for p in self.model.parameters():
        p.grad = torch.randn_like(p)
    self.optimizers.step()
    self.lr_schedulers.step()
    self.train_state.version += 1


def _trainer() -> Any:
    with open("configs/grpo.yaml") as f:
        cfg = yaml.safe_load(f)
    cls = ray.remote(Trainer).options(**on("node_a"))
    rank = spawn_trainer_ranks(cls, 1, 0, cfg["task"], cfg["model"], cfg["trainer"])[0]
    ray.get(rank.setup.remote())
    return rank


async def _measure(rank: Any, folder: str, variant: str, saves: int) -> dict[str, float]:
    tier, mode = VARIANTS[variant]
    memory = {"memory_every": 1, "durable_every": 10**9} if tier == "memory" else {}
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder, async_mode=mode, **memory))
    coord.set_trainer(rank)
    blocked, total = [], []
    try:
        for step in range(1, saves + 3):
            await rank.__ray_call__.remote(_optimizer_step)
            t0 = time.perf_counter()
            await coord.save(step, durable=False if tier == "memory" else None)
            t1 = time.perf_counter()
            await coord.wait(persisting=False)
            if step > 2:
                blocked.append(t1 - t0)
                total.append(time.perf_counter() - t0)
    finally:
        if coord.tier is not None:
            coord.tier.shutdown()
        coord.close()
    return {"blocked_s": statistics.median(blocked), "save_s": statistics.median(total)}


def measure(args: argparse.Namespace, root: str) -> dict[str, Any]:
    with environment(root, 64 * disk.MiB, "none"):
        rank = _trainer()
        rows = {}
        for n, variant in enumerate(VARIANTS):
            folder = os.path.join(root, f"ckpt{n}")
            rows[variant] = asyncio.run(_measure(rank, folder, variant, args.saves))
            print(variant, {k: f"{v * 1e3:.1f} ms" for k, v in rows[variant].items()}, flush=True)
    return {
        "saves": args.saves,
        "rows": rows,
        **sections.stamp(f"python -m benchmarks.grpo.save --saves {args.saves}"),
    }


def markdown(res: dict[str, Any]) -> str:
    begin, end = sections.markers("grpo_save")
    base = res["rows"]["local disk"]["save_s"]
    lines = [
        begin,
        "## One save of the GRPO trainer: memory tier vs local disk",
        "",
        f"The app's trainer (`configs/grpo.yaml`, one rank) on a worker node of a 3-node "
        f"cluster on this machine ({res['cpus']} cores); median of {res['saves']} saves, an "
        f"optimizer step between two. `{res['command']}` ({res['date']}).",
        "",
        "| target | `save()` blocked | until committed | vs local disk |",
        "|---|---|---|---|",
    ]
    for v, row in res["rows"].items():
        ratio = "baseline" if v == "local disk" else f"{row['save_s'] / base:.2f}x"
        lines.append(f"| {v} | {row['blocked_s'] * 1e3:.1f} ms | {row['save_s'] * 1e3:.1f} ms "
                     f"| {ratio} |")  # fmt: skip
    lines += ["", end]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--saves", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="5 saves, report not written")
    args = p.parse_args(argv)
    if args.quick:
        args.saves = 5
    sections.measure_and_write("grpo_save", lambda root: measure(args, root), markdown,
                               write=not args.quick)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
