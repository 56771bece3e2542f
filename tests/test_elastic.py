"""A trainer saved by N ranks loads into M ranks (1->2, 2->1, 2->4; FSDP2 on gloo): model
weights, optimizer moments and the LR schedule equal the saved ones exactly (full tensors
compared), and each rank's RNG streams follow the documented rule (rank r < N gets saved rank
r's streams, an added rank r >= N streams derived from saved rank r mod N's: rng.derive)."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import ray
import torch

from forge_ckpt import CheckpointConfig, CheckpointCoordinator, spawn_trainer_ranks
from forge_ckpt.actors.rng import derive

sys.path.insert(0, os.path.dirname(__file__))
import _trainer_model  # noqa: E402


@pytest.fixture(scope="module")
def rank_cls(ray_local):
    ray_local.cloudpickle.register_pickle_by_value(_trainer_model)
    return ray_local.remote(num_cpus=0)(_trainer_model.TrainerRank)


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))


def ranks_of(rank_cls, world: int, seed: int) -> list:
    ranks = spawn_trainer_ranks(rank_cls, world)
    ray.get([r.setup.remote(seed) for r in ranks])
    return ranks


@pytest.mark.parametrize("saved_world, loaded_world", [(1, 2), (2, 1), (2, 4)])
def test_trainer_loads_into_another_world_size(rank_cls, tmp_path, saved_world, loaded_world):
    folder = str(tmp_path / "ckpt")
    ranks = ranks_of(rank_cls, saved_world, seed=0)
    ray.get([r.train.remote(3) for r in ranks])
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder))
    coord.set_trainer(ranks)
    asyncio.run(coord.save(3))
    coord.close()
    saved = ray.get([r.summary.remote() for r in ranks])[0]  # a collective: every rank
    saved_rng = ray.get([r.rng_state.remote() for r in ranks])
    for r in ranks:
        ray.kill(r)

    fresh = ranks_of(rank_cls, loaded_world, seed=7)  # other weights and seeds
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder))
    coord.set_trainer(fresh)
    assert asyncio.run(coord.load()).step == 3  # no allow_mismatch needed: DCP reshards
    coord.close()
    got = ray.get([r.summary.remote() for r in fresh])[0]
    for key in ("full_params", "full_moments"):
        assert got[key].keys() == saved[key].keys()
        for name in saved[key]:
            assert bitwise(got[key][name], saved[key][name]), f"{key} {name}"
    assert (got["lr"], got["last_lr"], got["last_epoch"]) == (
        saved["lr"],
        saved["last_lr"],
        saved["last_epoch"],
    )
    assert got["train_step"] == saved["train_step"] == 3
    rng = ray.get([r.rng_state.remote() for r in fresh])
    for rank, state in enumerate(rng):  # rank r < N restored saved rank r's streams; an
        want = saved_rng[rank % saved_world]  # added rank derived distinct ones from r mod N's
        if rank >= saved_world:
            want = derive(want, rank)
            assert not any(bitwise(state["torch_cpu"], s["torch_cpu"]) for s in saved_rng)
        assert bitwise(state["torch_cpu"], want["torch_cpu"])
        assert state["generators"]["data"] == want["generators"]["data"]
    for r in fresh:
        ray.kill(r)
