"""A tiny trainer rank for tests: an MLP with dropout, TorchTitan's AdamW and warmup schedule.

World size 1 trains a plain module; larger worlds shard it with FSDP2 on a CPU device mesh, so
every rank holds different shards. The data comes from a named numpy generator (restored by
forge_ckpt) plus Python's global `random`; dropout draws from torch's global stream: a resume
is bitwise exact only if all three are restored.
"""

from __future__ import annotations

import os
import random
import threading
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from forge_ckpt.actors import rng
from forge_ckpt.trainer.checkpointer import TrainerCheckpointer
from forge_ckpt.trainer.ranks import TrainerMixin


def build_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank
    return nn.Sequential(
        nn.Linear(8, 32),
        nn.ReLU(),
        nn.Dropout(0.25),
        nn.Linear(32, 24),
        nn.ReLU(),
        nn.Dropout(0.25),
        nn.Linear(24, 4),
    )


def build_optim(model: nn.Module) -> tuple[Any, Any]:
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    config = default_adamw(lr=1e-2)
    config.implementation = "for-loop"
    optimizers = config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=5).build(
        optimizers=optimizers, training_steps=40
    )
    return optimizers, schedulers


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def optim_summary(optimizers: Any, view) -> dict[str, torch.Tensor]:
    out = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for name, p in zip(group["param_names"], group["params"], strict=True):
                for key, value in opt.state.get(p, {}).items():
                    out[f"{name}.{key}"] = view(value)
    return out


class TrainState:
    """A Stateful beyond model/optimizer/LR (TorchTitan's `states=`): saved by DCP."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


class TrainerRank(TrainerMixin):
    """Wrapped with `ray.remote` by the tests; `setup()` runs after the process group exists."""

    def setup(self, seed: int = 0) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.model = build_model(seed)
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in self.model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.optimizers, self.lr_schedulers = build_optim(self.model)
        self.train_state = TrainState()
        torch.manual_seed(100 + rank)  # dropout masks differ per rank
        random.seed(200 + rank)
        np.random.seed(300 + rank)
        self.data_rng = np.random.default_rng(400 + rank)
        self.checkpointer = TrainerCheckpointer(
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            rng_generators={"data": self.data_rng},
        )

    def train(self, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            x = torch.from_numpy(self.data_rng.standard_normal((16, 8), dtype=np.float32))
            y = x[:, :4] * 2.0 + random.random()
            loss = F.mse_loss(self.model(x), y)
            loss.backward()
            self.optimizers.step()
            self.lr_schedulers.step()
            self.optimizers.zero_grad()
            self.train_state.step += 1
            losses.append(loss.item())
        return losses

    def probe(self) -> dict[str, Any]:
        """Draw from every stream (same draws in the original and the resumed run)."""
        return {
            "torch": torch.rand(5),
            "python": random.random(),
            "numpy": np.random.rand(3),
            "data": self.data_rng.random(3),
        }

    def summary(self) -> dict[str, Any]:
        """This rank's shards of weights and optimizer state, plus full tensors (a collective)."""
        params = dict(self.model.named_parameters())
        opt = self.optimizers.optimizers[0]
        return {
            "params": {n: local(p) for n, p in params.items()},
            "full_params": {n: full(p) for n, p in params.items()},
            "moments": optim_summary(self.optimizers, local),
            "full_moments": optim_summary(self.optimizers, full),
            "lr": [g["lr"] for g in opt.param_groups],
            "last_lr": self.lr_schedulers.schedulers[0].get_last_lr(),
            "last_epoch": self.lr_schedulers.schedulers[0].last_epoch,
            "train_step": self.train_state.step,
        }

    def rng_state(self) -> dict[str, Any]:
        """Every RNG stream as forge_ckpt captures it, without drawing from any."""
        return rng.capture({"data": self.data_rng})

    def inject_fault(self, spec: str | None) -> None:
        """Make forge_ckpt's own writes in this process fail (see storage.FORGE_CKPT_FAULT)."""
        if spec is None:
            os.environ.pop("FORGE_CKPT_FAULT", None)
        else:
            os.environ["FORGE_CKPT_FAULT"] = spec

    def hold_background_writes(self) -> None:
        """Make the next background DCP write wait until `release_background_writes()`, so a
        test can change the weights while that save is certainly still in flight."""
        self._gate = threading.Event()
        original = dcp.save

        def gated(*args: Any, **kwargs: Any) -> Any:
            self._gate.wait()
            dcp.save = original
            return original(*args, **kwargs)

        dcp.save = gated

    def release_background_writes(self) -> None:
        self._gate.set()

    def object_collectives_of_a_save(self, step_dir: str) -> int:
        """A synchronous save, counting the pickled-object collectives DCP made on the way
        (its plans and results go through these)."""
        names = ("gather_object", "scatter_object_list", "broadcast_object_list",
                 "all_gather_object")  # fmt: skip
        originals, calls = {n: getattr(dist, n) for n in names}, []

        def counted(name: str) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                calls.append(name)
                return originals[name](*args, **kwargs)

            return call

        for n in names:
            setattr(dist, n, counted(n))
        try:
            self.forge_begin_save(step_dir, "", False)
        finally:
            for n in names:
                setattr(dist, n, originals[n])
        return len(calls)

    def hold_snapshot_copies(self) -> None:
        """Hold every deferred snapshot copy (before it reads anything) until a training
        step waits for it: the step certainly arrives while the copy runs, however busy the
        machine (a copy slowed by a fixed second could end before a step that came late)."""
        checkpointer = self.checkpointer
        buffers, waiting = checkpointer._snapshot, threading.Event()
        original, real_wait = type(buffers).copy, checkpointer.wait_for_snapshot

        def wait_for_snapshot() -> float:
            waiting.set()  # (the copy is held: it cannot have ended yet)
            return real_wait()

        def held(state: Any) -> Any:
            assert waiting.wait(300), "no training step came to wait for the copy"
            return original(buffers, state)

        checkpointer.wait_for_snapshot = wait_for_snapshot  # type: ignore[method-assign]
        buffers.copy = held

    def stall_s(self) -> float:
        """How long this rank's optimizer steps waited for a deferred snapshot copy."""
        return self.checkpointer.stall_s


class StockLoader:
    """Stock TorchTitan, configured as a user would, loading `step-N` from our folder."""

    def load(self, folder: str, step: int) -> dict[str, Any]:
        from torchtitan.components.checkpoint import CheckpointManager

        model = build_model(seed=123)  # different init: the load must overwrite it
        optimizers, schedulers = build_optim(model)
        manager = CheckpointManager.Config(enable=True, folder=folder).build(
            dataloader=None,
            model_parts=[model],
            optimizers=optimizers,
            lr_schedulers=schedulers,
            states={},
            sd_adapter=None,
        )
        loaded = manager.load(step=step)
        manager.close()
        return {
            "loaded": loaded,
            "full_params": {n: full(p) for n, p in model.named_parameters()},
            "full_moments": optim_summary(optimizers, full),
            "last_epoch": schedulers.schedulers[0].last_epoch,
        }
