"""forge_ckpt.actors.weights (weights stored once: references to the trainer's version or to the owner
component, checked when filled) and rng.derive (distinct streams for added replicas/ranks)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from forge_ckpt import CheckpointMismatchError
from forge_ckpt.actors import rng
from forge_ckpt.actors.immutable import Immutable
from forge_ckpt.actors.weights import WeightVersions, is_ref


def weights(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 2), v)}


def test_trainer_version_and_non_owner_versions_are_references():
    wv = WeightVersions()
    for v in (3, 4, 5):
        wv.put(v, weights(v))
    wv.keep_from(4)
    owner = wv.state_dict(trainer_version=5, owner=True, owner_name="gen[0]")
    other = wv.state_dict(trainer_version=5, owner=False, owner_name="gen[0]")
    assert sorted(owner) == sorted(other) == ["4", "5"]  # 3 dropped by keep_from
    assert owner["5"] == other["5"] == {"ref": "trainer", "version": 5}
    assert isinstance(owner["4"], Immutable) and torch.equal(owner["4"].value["w"], weights(4)["w"])
    assert other["4"] == {"ref": "gen[0]", "version": 4}
    with pytest.raises(ValueError, match="newer than the trainer's 4"):
        wv.state_dict(trainer_version=4, owner=True, owner_name="gen[0]")


def test_references_are_filled_only_with_the_version_they_name():
    wv = WeightVersions()
    wv.load_state_dict(
        {"4": {"ref": "gen[0]", "version": 4}, "5": {"ref": "trainer", "version": 5}}
    )
    assert wv.missing() == {4: "gen[0]", 5: "trainer"}
    with pytest.raises(RuntimeError, match="not filled yet"):
        wv.get(5)
    with pytest.raises(CheckpointMismatchError, match="'trainer' holds version 6"):
        wv.fill(5, weights(6), "trainer", 6)  # the restored trainer is at another version
    wv.fill(5, weights(5), "trainer", 5)
    wv.fill(4, weights(4), "gen[0]", 4)
    assert wv.missing() == {} and torch.equal(wv.get(4)["w"], weights(4)["w"])
    assert all(not is_ref(e) for e in wv.held.values())


def draws(state: dict) -> tuple:
    """The next numbers of every stream after restoring `state`."""
    gens = {"g": torch.Generator(), "n": np.random.default_rng(0), "p": random.Random(0)}
    rng.restore(state, gens)
    return (
        random.random(),
        float(np.random.rand()),
        float(torch.rand(1)),
        float(torch.rand(1, generator=gens["g"])),
        float(gens["n"].random()),
        gens["p"].random(),
    )


def test_derived_streams_are_distinct_per_member_and_deterministic():
    gens = {"g": torch.Generator().manual_seed(1), "n": np.random.default_rng(1),
            "p": random.Random(1)}  # fmt: skip
    saved = rng.capture(gens)
    before = draws(saved)
    derived = [draws(rng.derive(saved, j)) for j in (2, 3)]
    assert draws(rng.derive(saved, 2)) == derived[0]  # a function of the checkpoint and j
    numbers = [x for d in (before, *derived) for x in d]
    assert len(set(numbers)) == len(numbers)  # no stream repeats another's draws
