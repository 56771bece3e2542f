"""A load applies every component or none, and when an apply still fails its error says which
components were applied (issue 22, items 9 and 13a), with real Ray actors and a real trainer.

Load is two-phase: every unit prepares (reads, verifies, checks that the state fits), then every
unit applies. Everything that can be checked ahead (a tensor's shape against the live model, an
RNG generator's name or kind) is refused in prepare, so no component has changed yet; a
component's own `load_state_dict` raising in apply is reported with the components applied and
those not; a trainer shard replaced between prepare and apply is refused, never loaded.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import ray
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
import _trainer_model  # noqa: E402

from forge_ckpt import (  # noqa: E402
    Checkpointable,
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    spawn_trainer_ranks,
)
from forge_ckpt.actors import rng  # noqa: E402
from forge_ckpt.coordination import components  # noqa: E402
from forge_ckpt.coordination.apply import apply_all  # noqa: E402
from forge_ckpt.steps import layout  # noqa: E402
from forge_ckpt.trainer.checkpointer import TrainerCheckpointer  # noqa: E402

KEY = "load-atomic-key"  # signed: the trainer's files carry BLAKE3 digests


@ray.remote
class Keeper(Checkpointable):
    """A value and one named RNG stream; `boom` makes its load_state_dict raise."""

    def __init__(self, value: int, kind: str = "python", boom: bool = False) -> None:
        self.value, self.boom = value, boom
        gen = random.Random(value) if kind == "python" else np.random.default_rng(abs(value))
        self.gens = {"g": gen}

    def rng_generators(self) -> dict[str, Any]:
        return self.gens

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.boom:
            raise ValueError("replay buffer does not fit")
        self.value = state["value"]

    def get(self) -> int:
        return self.value


class VariantRank(_trainer_model.TrainerRank):
    """The test trainer (world size 1) built with another hidden width or RNG name."""

    def setup_variant(self, hidden: int = 32, rng_name: str = "data") -> None:
        torch.manual_seed(7)
        self.model = nn.Sequential(
            nn.Linear(8, hidden),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(hidden, 24),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(24, 4),
        )
        self.optimizers, self.lr_schedulers = _trainer_model.build_optim(self.model)
        self.train_state = _trainer_model.TrainState()
        self.data_rng = np.random.default_rng(5)
        self.checkpointer = TrainerCheckpointer(
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            rng_generators={rng_name: self.data_rng},
        )


@dataclass
class Saved:
    folder: str
    rank_cls: Any
    ranks: list  # the trainer that saved steps 1 and 2
    keeper: Any
    other: Any


def coordinator(folder: str, ranks: list | None, keeper: Any, other: Any, **kw: Any):
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder, signing_key=KEY, **kw))
    if ranks is not None:
        coord.set_trainer(ranks)
    coord.register("keeper", keeper)
    coord.register("other", other)
    return coord


@pytest.fixture(scope="module")
def saved(ray_local, tmp_path_factory):
    ray_local.cloudpickle.register_pickle_by_value(_trainer_model)
    ray_local.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    rank_cls = ray_local.remote(num_cpus=0)(VariantRank)
    folder = str(tmp_path_factory.mktemp("atomic") / "ckpt")
    ranks = spawn_trainer_ranks(rank_cls, 1)
    ray.get(ranks[0].setup.remote(0))
    keeper, other = Keeper.remote(1), Keeper.remote(2)
    coord = coordinator(folder, ranks, keeper, other)
    ray.get(ranks[0].train.remote(2))
    asyncio.run(coord.save(1))
    ray.get(ranks[0].train.remote(2))  # step 2's weights differ from step 1's
    asyncio.run(coord.save(2))
    coord.close()
    yield Saved(folder, rank_cls, ranks, keeper, other)
    for h in (*ranks, keeper, other):
        ray.kill(h)


@pytest.fixture
def variant(saved):
    """A factory of fresh world-1 trainers built by `setup_variant(**kw)`."""
    made: list = []

    def spawn(**kw: Any) -> list:
        ranks = spawn_trainer_ranks(saved.rank_cls, 1)
        made.extend(ranks)
        ray.get(ranks[0].setup_variant.remote(**kw))
        return ranks

    yield spawn
    for r in made:
        ray.kill(r)


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Bitwise equality through dicts, lists and tensors; names the first difference."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=where)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def trainer_state(ranks: list) -> dict[str, Any]:
    return {
        "summary": ray.get(ranks[0].summary.remote()),
        "rng": ray.get(ranks[0].rng_state.remote()),
    }


async def test_a_changed_model_shape_is_refused_before_anything_is_applied(saved, variant):
    ranks = variant(hidden=16)
    keeper, other = Keeper.remote(-1), Keeper.remote(-2)
    before = trainer_state(ranks)
    coord = coordinator(saved.folder, ranks, keeper, other)
    try:
        with pytest.raises(CheckpointMismatchError) as e:
            await coord.load()
    finally:
        coord.close()
    assert "0.weight: shape [32, 8] in the checkpoint, [16, 8] now" in str(e.value)
    assert "state.0.weight.exp_avg: shape [32, 8]" in str(e.value)  # the optimizer, too
    assert [await keeper.get.remote(), await other.get.remote()] == [-1, -2]  # fresh
    after = trainer_state(ranks)
    assert_same(before, after, "trainer")  # untouched by the refused load
    assert after["summary"]["moments"] == {}, "the fresh optimizer stays fresh"


async def test_an_rng_generator_renamed_in_the_trainer_is_refused_in_prepare(saved, variant):
    ranks = variant(rng_name="noise")
    keeper, other = Keeper.remote(-1), Keeper.remote(-2)
    before = trainer_state(ranks)
    coord = coordinator(saved.folder, ranks, keeper, other)
    try:
        with pytest.raises(
            CheckpointMismatchError, match=r"checkpoint has \['data'\].*\['noise'\]"
        ):
            await coord.load()
    finally:
        coord.close()
    assert [await keeper.get.remote(), await other.get.remote()] == [-1, -2]
    assert_same(before, trainer_state(ranks), "trainer")


async def test_an_rng_generator_of_another_kind_in_an_actor_is_refused_in_prepare(saved):
    keeper, other = Keeper.remote(-1), Keeper.remote(-2, kind="numpy")
    coord = coordinator(saved.folder, None, keeper, other)
    try:
        with pytest.raises(
            CheckpointMismatchError, match="'g': checkpoint holds a python generator"
        ):
            await coord.load(exclude=["trainer"])
    finally:
        coord.close()
    assert [await keeper.get.remote(), await other.get.remote()] == [-1, -2]


def _prepared_plan(saved: Saved, keeper: Any, other: Any, step: int):
    groups = {
        layout.TRAINER: components.trainer_group(saved.ranks),
        "keeper": components.actor_group("keeper", [keeper]),
        "other": components.actor_group("other", [other]),
    }
    cfg = CheckpointConfig(folder=saved.folder, signing_key=KEY)
    manifest = layout.read_committed(saved.folder, step, cfg.signer)
    where = cfg.storage.child(layout.step_name(step))
    return groups, manifest, where


async def test_an_apply_that_fails_names_the_components_applied_and_not(saved):
    """The coordinator's apply phase is `apply.apply_all`: driven here on real units."""
    keeper, other = Keeper.remote(-1), Keeper.remote(-2, boom=True)
    groups, manifest, where = _prepared_plan(saved, keeper, other, 1)
    plan = await components.load_plan(groups, manifest, set(), where, True)
    await asyncio.gather(*(u.prepare(where, recs, True, opts) for u, recs, opts in plan))
    with pytest.raises(CheckpointError) as e:
        await apply_all([u for u, _, _ in plan], 1, 60.0)
    msg = str(e.value)
    assert "applied: trainer, keeper" in msg and "not applied: other" in msg, msg
    assert "actor 'other' replica 0: ValueError: replay buffer does not fit" in msg
    assert "nothing was applied" not in msg
    assert (e.value.applied, e.value.not_applied) == (["trainer", "keeper"], ["other"])
    assert await keeper.get.remote() == 1  # applied, as the error says


async def test_load_whose_apply_fails_names_the_components_applied(saved):
    keeper, other = Keeper.remote(-1), Keeper.remote(-2, boom=True)
    coord = coordinator(saved.folder, saved.ranks, keeper, other)
    try:
        with pytest.raises(CheckpointError) as e:
            await coord.load(step=1)
    finally:
        coord.close()
    assert "applied: trainer, keeper" in str(e.value) and "not applied: other" in str(e.value)


def test_a_trainer_shard_replaced_between_prepare_and_apply_is_refused(saved, tmp_path):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(saved.folder, folder)
    cfg = CheckpointConfig(folder=folder, signing_key=KEY)
    manifest = layout.read_committed(folder, 1, cfg.signer)
    records = [f.to_dict() for f in manifest.components[layout.TRAINER].files]
    where = cfg.storage.child(layout.step_name(1))
    rank = saved.ranks[0]
    options = {"rank_file": layout.trainer_rank_file(0), "saved_rank": 0}
    ray.get(rank.forge_prepare_load.remote(where, records, True, options))  # verifies step 1

    shard = os.path.join(layout.step_dir(folder, 1), "__0_0.distcp")
    newer = os.path.join(layout.step_dir(folder, 2), "__0_0.distcp")  # a valid shard, step 2's
    assert os.path.getsize(shard) == os.path.getsize(newer)
    shutil.copy(newer, shard + ".swap")
    os.replace(shard + ".swap", shard)

    with pytest.raises(ray.exceptions.RayTaskError) as e:
        ray.get(rank.forge_apply_load.remote())
    assert isinstance(e.value.cause, CheckpointCorruptError), e.value
    assert e.value.cause.path == shard


def test_rng_restore_changes_no_stream_when_a_generator_does_not_fit():
    state = rng.capture({"g": random.Random(1)})
    random.seed(5)
    torch.manual_seed(5)
    before = (random.getstate(), torch.random.get_rng_state())
    with pytest.raises(ValueError, match="'g': checkpoint holds a python generator"):
        rng.restore(state, {"g": np.random.default_rng(1)})
    assert random.getstate() == before[0] and torch.equal(torch.random.get_rng_state(), before[1])
    assert rng.differences(state, {"g": random.Random(2)}) == []
