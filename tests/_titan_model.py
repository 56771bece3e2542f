"""A trainer rank holding a real TorchTitan model (llama3 or qwen3 debug flavors), FSDP2-sharded
over the ranks on CPU, for the Hugging Face export tests.

TorchTitan's models cannot train on CPU (flex attention has no CPU backward), so the weights
are the model's own random init plus seeded noise (every norm weight differs from 1, every
value from its neighbour): enough to tell a wrong permutation or a swapped tensor apart.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from forge_ckpt.trainer.checkpointer import TrainerCheckpointer
from forge_ckpt.trainer.ranks import TrainerMixin


def build(family: str, flavor: str, seed: int) -> torch.nn.Module:
    """The TorchTitan model `family:flavor`, initialised and perturbed from `seed` (the same
    weights on every rank and in the test that checks them)."""
    spec = importlib.import_module(f"torchtitan.models.{family}").model_registry(flavor)
    torch.manual_seed(seed)
    model = spec.model.build()
    model.init_states()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.01)
    return model


class TitanRank(TrainerMixin):
    """Wrapped with `ray.remote` by the tests; one `setup` per model, after the process group."""

    def setup(self, family: str, flavor: str, seed: int) -> None:
        if getattr(self, "checkpointer", None) is not None:
            self.checkpointer.close()
        self.model = build(family, flavor, seed)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in self.model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

        self.optimizers = default_adamw(lr=1e-3).build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=10
        )
        self.checkpointer = TrainerCheckpointer(
            model_parts=[self.model], optimizers=self.optimizers, lr_schedulers=self.lr_schedulers
        )

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
        """The model's whole state dict, gathered, and this rank's shard shapes (a collective:
        call on every rank; TorchTitan's fused QKV splits itself with one too)."""
        sd = self.model.state_dict()
        full = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in sd.items()
        }
        local = {k: tuple(v.to_local().shape) for k, v in sd.items() if isinstance(v, DTensor)}
        return full, local
