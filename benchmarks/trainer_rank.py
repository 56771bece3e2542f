"""The trainer rank under test: TorchTitan's optimizer containers behind forge_ckpt's
TrainerMixin, plus the torch.save and TorchTitan-alone baselines on the very same tensors.

Only the trainer process imports this module (it imports TorchTitan, seconds per process).
"""

from __future__ import annotations

import gc
import math
import os
import time
from typing import Any

import numpy as np
import torch
from torch import nn
from torchtitan.components.checkpointer import AsyncMode, CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from forge_ckpt.trainer.checkpointer import TrainerCheckpointer, flat_state
from forge_ckpt.trainer.ranks import TrainerMixin

from .timers import install_timers, rss, take_phases

TRAINER_LAYERS = 16


def model_for(nbytes: int, layers: int = TRAINER_LAYERS) -> nn.Module:
    """An MLP whose weights + AdamW moments (exp_avg, exp_avg_sq) are about `nbytes` in fp32:
    12 bytes per parameter, `layers` square Linear layers."""
    params = max(nbytes // 12, layers * 64)
    width = max(8, int(math.sqrt(params / layers)))
    blocks: list[nn.Module] = []
    for i in range(layers):
        blocks.append(nn.Linear(width, width))
        if i + 1 < layers:
            blocks.append(nn.ReLU())
    return nn.Sequential(*blocks)


def _stateful_resolved(state: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.stateful import Stateful

    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


class BenchTrainer(TrainerMixin):
    """One trainer rank: TorchTitan's OptimizersContainer (AdamW) and LRSchedulersContainer,
    a forge_ckpt TrainerCheckpointer, and TorchTitan-alone / torch.save baselines on the very
    same tensors. Wrapped with `ray.remote` by the runner."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self._titan_async: CheckpointManager | None = None
        self._pinned: list[torch.Tensor] | None = None

    def setup(self, nbytes: int, device: str) -> dict[str, Any]:
        """(Re)build model and optimizer of about `nbytes` state and take one optimizer step
        (so that the AdamW moments exist). Returns sizes and the build time."""
        install_timers("trainer")
        self._teardown()
        start = time.perf_counter()
        torch.manual_seed(0)
        self.device = torch.device(device)
        self.model = model_for(nbytes).to(self.device)
        self.optimizers = default_adamw(lr=1e-4).build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=1000
        )
        self.train_step()
        self.data_rng = np.random.default_rng(0)
        self.checkpointer = TrainerCheckpointer(
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            rng_generators={"data": self.data_rng},
        )
        state = _stateful_resolved(flat_state(self.checkpointer.manager.states))
        params = sum(p.numel() for p in self.model.parameters())
        take_phases()
        return {
            "params": params,
            "tensor_bytes": _tensor_bytes(state),
            "tensors": _count_tensors(state),
            "setup_s": time.perf_counter() - start,
            "device": str(self.device),
            "rss": rss(),
        }

    def train_step(self) -> float:
        assert self.model is not None
        width = self.model[0].in_features
        x = torch.randn(4, width, device=self.device)
        loss = self.model(x).square().mean()
        loss.backward()
        self.optimizers.step()
        self.lr_schedulers.step()
        self.optimizers.zero_grad()
        return float(loss)

    def _teardown(self) -> None:
        if self.model is None:
            return
        self.checkpointer.close()
        if self._titan_async is not None:
            self._titan_async.close()
            self._titan_async = None
        self.checkpointer.manager.close()
        del self.checkpointer, self.optimizers, self.lr_schedulers, self.model
        self.model = None
        self._pinned = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # -- baselines on the same tensors --

    def torch_save(self, path: str) -> float:
        """`torch.save` of TorchTitan's state dict (model + optimizer + LR schedule) + fsync."""
        self._sync()
        start = time.perf_counter()
        state = _stateful_resolved(flat_state(self.checkpointer.manager.states))
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - start

    def titan_save(self, path: str, mode: str) -> dict[str, float]:
        """TorchTitan's `CheckpointManager.dcp_save` to an explicit folder.

        mode 'sync': AsyncMode.DISABLED. mode 'async': AsyncMode.ASYNC (DCP stages a CPU copy,
        then writes in a thread); `blocked_s` is the time dcp_save held the caller.
        TorchTitan's `_save` also runs `gc.collect()` around it; that is not timed here."""
        self._sync()
        if mode == "sync":
            manager = self.checkpointer.manager
            start = time.perf_counter()
            manager.dcp_save(
                flat_state(manager.states),
                checkpoint_id=path,
                async_mode=AsyncMode.DISABLED,
            )
            total = time.perf_counter() - start
            return {"blocked_s": total, "total_s": total}
        if self._titan_async is None:
            self._titan_async = CheckpointManager.Config(
                enable=True,
                folder="unused",
                keep_latest_k=0,
                async_mode="async",
                initial_load_model_only=False,  # no initial load here (it warns otherwise)
            ).build(
                dataloader=None,
                model_parts=[self.model],
                optimizers=self.optimizers,
                lr_schedulers=self.lr_schedulers,
                states={},
                sd_adapter=None,
            )
        manager = self._titan_async
        start = time.perf_counter()
        future = manager.dcp_save(
            flat_state(manager.states), checkpoint_id=path, async_mode=AsyncMode.ASYNC
        )
        blocked = time.perf_counter() - start
        future.result()
        return {"blocked_s": blocked, "total_s": time.perf_counter() - start}

    def d2h_copy(self) -> float:
        """The floor of a GPU snapshot: copy every tensor of the state into pinned CPU buffers
        allocated once (the first call), synchronously, as a bare loop of `copy_`."""
        state = _stateful_resolved(flat_state(self.checkpointer.manager.states))
        tensors = _tensors(state)
        if self._pinned is None or len(self._pinned) != len(tensors):
            self._pinned = [torch.empty_like(t, device="cpu").pin_memory() for t in tensors]
        self._sync()
        start = time.perf_counter()
        for dst, src in zip(self._pinned, tensors, strict=True):
            dst.copy_(src)
        self._sync()
        return time.perf_counter() - start

    def titan_load(self, path: str) -> float:
        """TorchTitan's `dcp_load` of a folder that `titan_save` wrote (caches dropped first)."""
        manager = self.checkpointer.manager
        start = time.perf_counter()
        manager.dcp_load(
            flat_state(manager.states),
            checkpoint_id=path,
            from_hf=False,
            from_quantized=False,
        )
        self._sync()
        return time.perf_counter() - start

    def phases(self) -> dict[str, Any]:
        out = take_phases()
        out["rss"] = rss()
        return out


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _count_tensors(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(_count_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_count_tensors(v) for v in obj)
    return 0
