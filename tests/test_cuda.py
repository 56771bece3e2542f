"""On a CUDA machine: CUDA RNG streams, CUDA tensors and a GPU trainer survive save and load.

Skipped without a GPU (CI has none). The trainer's async save must hold the weights of the step
it was asked for even though training goes on on the GPU while the write runs.
"""

from __future__ import annotations

import pytest
import ray
import torch
import torch.nn as nn
import torch.nn.functional as F

from forge_ckpt import Checkpointable, CheckpointConfig, CheckpointCoordinator
from forge_ckpt.trainer.checkpointer import TrainerCheckpointer
from forge_ckpt.trainer.ranks import TrainerMixin, spawn_trainer_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


class CudaSampler(Checkpointable):
    """Draws from CUDA's global stream and from a declared CUDA generator."""

    def __init__(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.weights = torch.randn(64, 64, device="cuda", generator=self.gen)

    def rng_generators(self):
        return {"cuda": self.gen}

    def step(self) -> list[float]:
        draws = torch.cat(
            [torch.rand(4, device="cuda"), torch.rand(4, device="cuda", generator=self.gen)]
        )
        self.weights += torch.randn(self.weights.shape, device="cuda", generator=self.gen)
        return draws.cpu().tolist()

    def state_dict(self):
        return {"weights": self.weights}

    def load_state_dict(self, state):
        self.weights = state["weights"].to("cuda")

    def get(self) -> torch.Tensor:
        return self.weights.cpu()


class CudaTrainer(TrainerMixin):
    """One rank on the GPU: dropout draws from the CUDA stream, data from a CUDA generator."""

    def setup(self, seed: int) -> None:
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

        torch.manual_seed(seed)
        self.model = nn.Sequential(
            nn.Linear(8, 256), nn.ReLU(), nn.Dropout(0.25), nn.Linear(256, 4)
        ).cuda()
        self.optimizers = default_adamw(lr=1e-2).build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(
            optimizers=self.optimizers, training_steps=50
        )
        torch.cuda.manual_seed(seed + 1)
        self.gen = torch.Generator(device="cuda").manual_seed(seed + 2)
        self.checkpointer = TrainerCheckpointer(
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            rng_generators={"data": self.gen},
        )

    def train(self, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            x = torch.randn(32, 8, device="cuda", generator=self.gen)
            loss = F.mse_loss(self.model(x), x[:, :4] * 2.0)
            loss.backward()
            self.optimizers.step()
            self.lr_schedulers.step()
            self.optimizers.zero_grad()
            losses.append(loss.item())
        return losses

    def state(self) -> dict[str, torch.Tensor]:
        out = {f"param.{k}": v.detach().cpu() for k, v in self.model.state_dict().items()}
        opt = self.optimizers.optimizers[0]
        for i, p in enumerate(self.model.parameters()):
            for key, value in opt.state[p].items():
                out[f"opt.{i}.{key}"] = value.detach().cpu()
        return out


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


async def test_cuda_rng_streams_and_tensors_resume(ray_local, tmp_path):
    cfg = CheckpointConfig(folder=str(tmp_path / "ckpt"))
    sampler = ray.remote(num_gpus=0.25)(CudaSampler).remote(1)
    coord = CheckpointCoordinator(cfg)
    coord.register("sampler", sampler)
    for _ in range(3):
        await sampler.step.remote()
    await coord.save(3)
    saved = await sampler.get.remote()
    expected = [await sampler.step.remote() for _ in range(3)]
    coord.close()
    ray.kill(sampler)

    fresh = ray.remote(num_gpus=0.25)(CudaSampler).remote(99)
    coord = CheckpointCoordinator(cfg)
    coord.register("sampler", fresh)
    assert (await coord.load()).step == 3
    assert torch.equal(await fresh.get.remote(), saved)
    assert [await fresh.step.remote() for _ in range(3)] == expected
    coord.close()
    ray.kill(fresh)


@pytest.mark.parametrize("async_mode", ["sync", "deferred"])
async def test_gpu_trainer_resumes_bitwise(ray_local, tmp_path, async_mode):
    cfg = CheckpointConfig(folder=str(tmp_path / "ckpt"), async_mode=async_mode)
    trainer_cls = ray.remote(num_gpus=0.5)(CudaTrainer)
    [trainer] = spawn_trainer_ranks(trainer_cls, 1)
    await trainer.setup.remote(0)
    coord = CheckpointCoordinator(cfg)
    coord.set_trainer(trainer)
    await trainer.train.remote(2)
    await coord.save(2)  # a second save reuses the first one's staging buffers
    await trainer.train.remote(2)
    await coord.save(4)
    saved = await trainer.state.remote()
    expected = await trainer.train.remote(5)  # runs while an async write may still be going on
    await coord.wait()
    coord.close()
    ray.kill(trainer)

    [fresh] = spawn_trainer_ranks(trainer_cls, 1)
    await fresh.setup.remote(7)
    coord = CheckpointCoordinator(cfg)
    coord.set_trainer(fresh)
    assert (await coord.load()).step == 4
    assert_bitwise(await fresh.state.remote(), saved)
    assert await fresh.train.remote(5) == expected
    coord.close()
    ray.kill(fresh)
