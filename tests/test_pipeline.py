"""Pipeline stages: a trainer whose ranks hold different `model_parts` saves one DCP step (one
folder, FQN-keyed, as TorchTitan writes it) and loads it into another pipeline shape: 2 stages
on 2 ranks -> 2 stages on 1 rank (two model parts) and -> 1 stage holding the whole model, with
weights, optimizer moments and LR schedule equal to the saved ones; training then continues
bitwise as the uninterrupted 2-rank pipeline does."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import ray
import torch

from forge_ckpt import CheckpointConfig, CheckpointCoordinator, spawn_trainer_ranks

sys.path.insert(0, os.path.dirname(__file__))
import _pipeline_model  # noqa: E402
import _trainer_model  # noqa: E402


@pytest.fixture(scope="module")
def rank_cls(ray_local):
    for module in (_trainer_model, _pipeline_model):
        ray_local.cloudpickle.register_pickle_by_value(module)
    return ray_local.remote(num_cpus=0)(_pipeline_model.PipelineRank)


def pipeline(rank_cls, world: int, n_stages: int, seed: int) -> list:
    ranks = spawn_trainer_ranks(rank_cls, world)
    ray.get([r.setup.remote(n_stages, seed) for r in ranks])
    return ranks


def merged(states: list[dict]) -> dict:
    """The whole model's state from every rank's part (the parts must be disjoint)."""
    out: dict = {"params": {}, "moments": {}, "last_epoch": {s["last_epoch"] for s in states}}
    for s in states:
        for key in ("params", "moments"):
            assert not set(out[key]) & set(s[key]), "stages overlap"
            out[key].update(s[key])
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a["last_epoch"] == b["last_epoch"]
    for key in ("params", "moments"):
        assert a[key].keys() == b[key].keys()
        for name, t in a[key].items():
            assert torch.equal(t, b[key][name]), f"{key} {name} differs"


@pytest.fixture(scope="module")
def saved(rank_cls, tmp_path_factory):
    """A 2-stage pipeline on 2 ranks trained 3 steps and saved at step 3, then trained 2 more."""
    folder = str(tmp_path_factory.mktemp("pp") / "ckpt")
    ranks = pipeline(rank_cls, world=2, n_stages=2, seed=0)
    ray.get([r.train.remote(3) for r in ranks])
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder))
    coord.set_trainer(ranks)
    asyncio.run(coord.save(3))
    coord.close()
    state = merged(ray.get([r.state.remote() for r in ranks]))
    later = [loss for losses in ray.get([r.train.remote(2) for r in ranks]) for loss in losses]
    for r in ranks:
        ray.kill(r)
    return folder, state, later


@pytest.mark.parametrize("world, n_stages", [(2, 2), (1, 2), (1, 1)])
def test_pipeline_step_loads_into_another_stage_layout(rank_cls, saved, world, n_stages):
    folder, state, later = saved
    ranks = pipeline(rank_cls, world, n_stages, seed=7)  # other initial weights
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder))
    coord.set_trainer(ranks)
    assert asyncio.run(coord.load()).step == 3
    coord.close()
    assert_same(merged(ray.get([r.state.remote() for r in ranks])), state)
    # The same arithmetic on any stage layout: the next steps' losses match the original run.
    losses = [loss for ls in ray.get([r.train.remote(2) for r in ranks]) for loss in ls]
    assert losses == later
    for r in ranks:
        ray.kill(r)
