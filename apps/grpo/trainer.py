"""Trainer: one Ray actor per rank, data-parallel over a gloo process group.

Every rank holds the whole model (it is tiny), takes a contiguous slice of the batch, and
computes the loss of its slice divided by the token count of the whole batch. The ranks'
gradients are then all-gathered and summed in rank order on every rank: unlike a ring
all-reduce, the order of the float additions is fixed, so every rank applies bit-identical
gradients and two runs with the same config produce the same weights bit for bit.

Optimizer and LR schedule are TorchTitan's `OptimizersContainer` (AdamW, "for-loop"
implementation: fused kernels are CUDA-only) and `LRSchedulersContainer`; the checkpoint is
TorchTitan's DCP state through `forge_ckpt.TrainerCheckpointer`. The schedule is a linear
warmup to a constant LR: it does not depend on `steps`, which may grow on resume.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from forge_ckpt import TrainerCheckpointer, TrainerMixin

from .actors import shapes
from .model import build_model
from .rl import grpo_loss, to_tensors
from .seeding import seed_process
from .task import Vocab


class TrainState(Stateful):
    """The policy version (= optimizer steps taken), saved in the DCP checkpoint as a tensor."""

    def __init__(self) -> None:
        self.version = 0

    def state_dict(self) -> dict[str, Any]:
        return {"version": torch.tensor(self.version, dtype=torch.int64)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.version = int(state_dict["version"])


class Trainer(TrainerMixin):
    def __init__(self, seed: int, task_cfg: dict, model_cfg: dict, trainer_cfg: dict) -> None:
        seed_process(seed, "trainer")
        self.seed = seed
        self.task_cfg, self.model_cfg, self.cfg = task_cfg, model_cfg, trainer_cfg

    def setup(self) -> int:
        """Build model, optimizer, schedule and checkpointer (after the process group)."""
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        vocab = Vocab(self.task_cfg["alphabet"])
        p, c = shapes(self.task_cfg)
        self.model = build_model(self.model_cfg, vocab.size, p + c, self.seed)
        self.ref_model = None
        if float(self.cfg["kl_beta"]) > 0:
            # The reference is the initial policy: rebuilt from the seed, so it is never saved.
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        opt_cfg = default_adamw(
            lr=float(self.cfg["lr"]),
            weight_decay=float(self.cfg["weight_decay"]),
            betas=tuple(self.cfg["betas"]),
        )
        opt_cfg.implementation = "for-loop"
        self.optimizers = opt_cfg.build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(
            warmup_steps=int(self.cfg["warmup_steps"]), total_steps=2**62, decay_ratio=0.0
        ).build(optimizers=self.optimizers, training_steps=2**62)
        self.train_state = TrainState()
        self.checkpointer = TrainerCheckpointer(
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
        )
        return self.rank

    def version(self) -> int:
        return self.train_state.version

    def get_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def train_step(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """One optimizer step on the whole batch (this rank computes its slice)."""
        n = len(batch["advantage"])
        lo, hi = n * self.rank // self.world_size, n * (self.rank + 1) // self.world_size
        total_tokens = max(int(batch["completion_mask"].sum()), 1)
        mine = to_tensors({k: v[lo:hi] for k, v in batch.items()})
        self.model.train()
        self.optimizers.zero_grad()
        loss, stats = grpo_loss(
            self.model,
            mine,
            temperature=float(self.cfg["temperature"]),
            clip_eps=float(self.cfg["clip_eps"]),
            total_tokens=total_tokens,
            ref_model=self.ref_model,
            kl_beta=float(self.cfg["kl_beta"]),
        )
        loss.backward()
        local = torch.tensor([loss.item(), stats["clip_sum"], stats["kl_sum"]], dtype=torch.float64)
        totals = self._sum_over_ranks(local)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), float(self.cfg["max_grad_norm"])
        )
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        self.optimizers.step()
        self.lr_schedulers.step()
        self.train_state.version += 1
        return {
            "loss": float(totals[0]),
            "clip_frac": float(totals[1]) / total_tokens,
            "kl": float(totals[2]) / total_tokens,
            "grad_norm": float(grad_norm),
            "lr": float(lr),
            "version": self.train_state.version,
            "episodes": n,
            "tokens": total_tokens,
        }

    def _sum_over_ranks(self, local_stats: torch.Tensor) -> torch.Tensor:
        """Replace every grad by the rank-ordered sum of all ranks' grads; sum the stats."""
        if self.world_size == 1:
            return local_stats
        params = list(self.model.parameters())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        total = _ordered_sum(flat, self.world_size)
        offset = 0
        for p in params:
            p.grad = total[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        return _ordered_sum(local_stats, self.world_size)


def _ordered_sum(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """All-gather `t` and add the parts in rank order: the same bits on every rank."""
    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t.contiguous())
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total
