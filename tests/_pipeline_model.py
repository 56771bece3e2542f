"""A pipeline-parallel trainer rank for tests: a 4-layer MLP cut into stages.

Stage s holds a contiguous slice of the layers, kept under their full-model names
(`layers.2.weight` stays `layers.2.weight`, as TorchTitan's pipeline splitting keeps FQNs), so
every stage's state is a disjoint part of the whole model's. Stage s runs on rank s % world: with
world 2 and 2 stages each rank holds one stage and activations and gradients cross ranks through
gloo send/recv; with world 1 one rank holds every stage as separate `model_parts` (as virtual
stages do). The arithmetic is the same either way, so runs on both shapes stay bitwise equal.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _trainer_model import optim_summary

from forge_ckpt.trainer.checkpointer import TrainerCheckpointer
from forge_ckpt.trainer.ranks import TrainerMixin

DIMS = [(8, 32), (32, 32), (32, 24), (24, 4)]


class Stage(nn.Module):
    """Layers `first..last` of the whole model, under the whole model's names."""

    def __init__(self, seed: int, first: int, last: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # every stage builds the whole model, then keeps its slice
        layers = {str(i): nn.Linear(a, b) for i, (a, b) in enumerate(DIMS)}
        self.layers = nn.ModuleDict({k: v for k, v in layers.items() if first <= int(k) <= last})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, layer in self.layers.items():
            x = layer(x)
            if int(name) < len(DIMS) - 1:
                x = F.relu(x)
        return x


def stage_bounds(n_stages: int) -> list[tuple[int, int]]:
    per = len(DIMS) // n_stages
    return [(s * per, (s + 1) * per - 1) for s in range(n_stages)]


class PipelineRank(TrainerMixin):
    def setup(self, n_stages: int, seed: int = 0) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.owner = [s % self.world for s in range(n_stages)]
        self._input_grads: dict[int, torch.Tensor] = {}
        bounds = stage_bounds(n_stages)
        self.stages = {
            s: Stage(seed, *bounds[s]) for s in range(n_stages) if self.owner[s] == self.rank
        }
        parts = list(self.stages.values())
        self.optimizers, self.lr_schedulers = build_optim_parts(parts)
        self.data_rng = np.random.default_rng(500)  # the same batches on every rank
        self.checkpointer = TrainerCheckpointer(
            model_parts=parts,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            rng_generators={"data": self.data_rng},
        )

    def train(self, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            x = torch.from_numpy(self.data_rng.standard_normal((16, 8), dtype=np.float32))
            loss = self._forward_backward(x, x[:, :4] * 2.0)
            if loss is not None:
                losses.append(loss)
            self.optimizers.step()
            self.lr_schedulers.step()
            self.optimizers.zero_grad()
        return losses

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """One microbatch through every stage, then back (activations and gradients cross
        ranks where consecutive stages live on different ranks)."""
        n, act, saved = len(self.owner), x, {}
        for s in range(n):
            if self.owner[s] != self.rank:
                continue
            if s > 0 and self.owner[s - 1] != self.rank:
                act = torch.empty(16, DIMS[stage_bounds(n)[s][0]][0])
                dist.recv(act, src=self.owner[s - 1])
            inp = act.detach().requires_grad_(s > 0)
            act = self.stages[s](inp)
            saved[s] = (inp, act)
            if s < n - 1 and self.owner[s + 1] != self.rank:
                dist.send(act.detach(), dst=self.owner[s + 1])
        loss = None
        for s in reversed(range(n)):
            if self.owner[s] != self.rank:
                continue
            inp, out = saved[s]
            if s == n - 1:
                loss = F.mse_loss(out, y)
                loss.backward()
            else:
                grad = _grad_from(self, s, out)
                out.backward(grad)
            if s > 0:
                _grad_to(self, s, inp)
        return None if loss is None else loss.item()

    def state(self) -> dict[str, Any]:
        """This rank's parameters and optimizer moments by full-model name, and the LR step."""
        params = {n: p.detach().clone() for st in self.stages.values()
                  for n, p in st.named_parameters()}  # fmt: skip
        return {
            "params": params,
            "moments": optim_summary(self.optimizers, lambda t: t.detach().clone()),
            "last_epoch": self.lr_schedulers.schedulers[0].last_epoch,
        }


def _grad_from(rank: PipelineRank, s: int, out: torch.Tensor) -> torch.Tensor:
    """The gradient of stage s's output: stage s+1's input gradient, local or received."""
    nxt = s + 1
    if rank.owner[nxt] == rank.rank:
        return rank._input_grads.pop(nxt)
    grad = torch.empty_like(out)
    dist.recv(grad, src=rank.owner[nxt])
    return grad


def _grad_to(rank: PipelineRank, s: int, inp: torch.Tensor) -> None:
    """Hand stage s's input gradient to stage s-1 (kept locally or sent)."""
    if rank.owner[s - 1] == rank.rank:
        rank._input_grads[s] = inp.grad
    else:
        dist.send(inp.grad, dst=rank.owner[s - 1])


def build_optim_parts(parts: list[nn.Module]) -> tuple[Any, Any]:
    """TorchTitan's AdamW over the model parts (one optimizer per part, FQN-flattened)."""
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    config = default_adamw(lr=1e-2)
    config.implementation = "for-loop"
    optimizers = config.build(model_parts=parts)
    schedulers = LRSchedulersContainer.Config(warmup_steps=5).build(
        optimizers=optimizers, training_steps=40
    )
    return optimizers, schedulers
