"""Actors shared by the crash tests' driver (crash_child.py) and the test that checks its folder."""

from __future__ import annotations

import random

import numpy as np
import ray
import torch
from torch import nn

from forge_ckpt import Checkpointable


@ray.remote
class Sampler(Checkpointable):
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.history: list[float] = []

    def rng_generators(self):
        return {"rng": self.rng}

    def step(self) -> float:
        x = float(self.rng.random()) + random.random()
        self.history.append(x)
        return x

    def state_dict(self):
        return {"history": list(self.history), "blob": np.arange(100_000, dtype=np.float32)}

    def load_state_dict(self, state):
        self.history = list(state["history"])

    def get_history(self) -> list[float]:
        return list(self.history)


def _trainer_cls():
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from forge_ckpt import TrainerCheckpointer, TrainerMixin

    @ray.remote
    class Trainer(TrainerMixin):
        def setup(self, seed: int = 0) -> None:
            torch.manual_seed(seed)
            self.model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
            self.opt = default_adamw(lr=1e-2).build(model_parts=[self.model])
            self.lrs = LRSchedulersContainer.Config(warmup_steps=2).build(
                optimizers=self.opt, training_steps=100
            )
            self.checkpointer = TrainerCheckpointer(
                model_parts=[self.model], optimizers=self.opt, lr_schedulers=self.lrs
            )

        def train_step(self) -> float:
            x = torch.randn(8, 16)
            loss = self.model(x).pow(2).mean()
            loss.backward()
            for p in self.model.parameters():  # data parallel: average gradients
                torch.distributed.all_reduce(p.grad)
                p.grad /= torch.distributed.get_world_size()
            self.opt.step()
            self.opt.zero_grad()
            self.lrs.step()
            return float(loss)

        def fingerprint(self) -> list[float]:
            return [float(p.double().sum()) for p in self.model.parameters()]

    return Trainer


def make_trainer_ranks(world_size: int, seed: int = 0) -> list:
    from forge_ckpt import spawn_trainer_ranks

    ranks = spawn_trainer_ranks(_trainer_cls(), world_size)
    ray.get([r.setup.remote(seed) for r in ranks])
    return ranks
