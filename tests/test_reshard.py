"""Actors saved with N replicas load into M only through a declared resharding rule: the
ready-made rules (forge_ckpt.actors.reshard), rules given at registration and on the actor class,
the errors without a rule or with a failing one (nothing changed anywhere), and components
that are new or gone."""

from __future__ import annotations

import asyncio
import logging
import sys

import numpy as np
import pytest
import ray
import torch

from forge_ckpt import (
    Checkpointable,
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointMismatchError,
)
from forge_ckpt.actors.reshard import concat_split, merge_running_stats, repartition_indices

# ---- the ready-made rules ---------------------------------------------------------------


def test_concat_split_keeps_every_item_in_order():
    states = [
        {"items": [0, 1, 2, 3, 4], "obs": torch.arange(10.0).view(5, 2), "capacity": 8},
        {"items": [5, 6], "obs": torch.arange(10.0, 14.0).view(2, 2), "capacity": 8},
    ]
    new = concat_split(states, 3)
    assert [s["items"] for s in new] == [[0, 1, 2], [3, 4], [5, 6]]
    assert torch.equal(torch.cat([s["obs"] for s in new]), torch.arange(14.0).view(7, 2))
    assert [s["capacity"] for s in new] == [8, 8, 8]
    assert concat_split([np.arange(3), np.arange(3, 5)], 1)[0].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"state\['capacity'\] differs between replicas"):
        concat_split([{"items": [], "capacity": 8}, {"items": [], "capacity": 9}], 2)


def test_merge_running_stats_equals_statistics_of_all_samples():
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=n) for n in (5, 0, 11)]

    def stats(x):
        return {"count": len(x), "mean": float(x.mean()) if len(x) else 0.0,
                "M2": float(((x - x.mean()) ** 2).sum()) if len(x) else 0.0}  # fmt: skip

    whole = np.concatenate(parts)
    new = merge_running_stats([stats(p) for p in parts], 4)
    assert [s["count"] for s in new] == [4, 4, 4, 4]
    for s in new:  # every replica normalises with the statistics of every sample
        assert s["mean"] == pytest.approx(whole.mean())
        assert s["M2"] / s["count"] == pytest.approx(whole.var())
    again = merge_running_stats(new, 1)[0]  # merging the new states gives the same totals
    assert again["count"] == 16
    assert again["M2"] == pytest.approx(stats(whole)["M2"])


def test_repartition_indices_serves_the_rest_exactly_once_in_order():
    order = [7, 3, 9, 0, 5, 1, 8, 2]
    saved = [  # 2 replicas dealt order[k::2], each consumed 2
        {"epoch": 1, "consumed": [3, 7], "remaining": [5, 8]},
        {"epoch": 1, "consumed": [0, 9], "remaining": [1, 2]},
    ]
    for kw in ({}, {"order": order}):
        new = repartition_indices(saved, 3, **kw)
        assert [s["remaining"] for s in new] == [[5, 2], [1], [8]]  # order[4:][j::3]
        assert sorted(i for s in new for i in s["consumed"]) == [0, 3, 7, 9]
        assert all(s["epoch"] == 1 for s in new)
    with pytest.raises(ValueError, match="index twice"):
        repartition_indices([saved[0], {**saved[1], "consumed": [3]}], 1)
    with pytest.raises(ValueError, match="do not make up"):
        repartition_indices(saved, 1, order=order + [11])


# ---- rules in a real load ------------------------------------------------------------------
# One pool of actors serves every test (an actor start costs seconds on a busy machine):
# `reset` gives an actor the contents, capacity and RNG seed a test needs.


class Buffer(Checkpointable):
    """A replay-buffer-like actor with its own RNG stream and a capacity it validates."""

    def __init__(self) -> None:
        self.reset([])

    def reset(self, items: list[int], capacity: int = 8, seed: int = 0) -> None:
        self.items, self.capacity = list(items), capacity
        self.obs = torch.tensor(self.items, dtype=torch.float32)
        self.gen = torch.Generator().manual_seed(seed)

    def rng_generators(self):
        return {"gen": self.gen}

    def state_dict(self):
        return {"items": list(self.items), "obs": self.obs, "capacity": self.capacity}

    def validate_state_dict(self, state):
        if state["capacity"] != self.capacity:
            raise CheckpointMismatchError(
                [f"capacity changed: checkpoint={state['capacity']}, current={self.capacity}"]
            )
        return [f"holds {len(state['items'])} items"]

    def load_state_dict(self, state):
        self.items, self.obs = list(state["items"]), state["obs"].clone()

    def get(self):
        return self.items, self.obs

    def draw(self) -> float:
        return float(torch.rand(1, generator=self.gen))


class HookBuffer(Buffer):
    @staticmethod
    def reshard_states(states, replicas):
        return concat_split(states, replicas)


class PlainBuffer:
    """Not Checkpointable: its state passes through the driver."""

    def reset(self, items: list[int], capacity: int = 8, seed: int = 0) -> None:
        self.items = list(items)

    def state_dict(self):
        return {"items": self.items}

    def load_state_dict(self, state):
        self.items = list(state["items"])

    def get(self):
        return self.items, None


SAVED = [[0, 1, 2, 3, 4], [5, 6, 7]]  # two replicas' items
FRESH = [-1]  # what an actor holds before a load


@pytest.fixture(scope="module")
def pool(ray_local):
    ray_local.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers can't import it
    sizes = {Buffer: 4, HookBuffer: 3, PlainBuffer: 3}
    made = {cls: [ray_local.remote(num_cpus=0)(cls).remote() for _ in range(n)]
            for cls, n in sizes.items()}  # fmt: skip
    yield made
    for handles in made.values():
        for a in handles:
            ray.kill(a)


def fill(handles: list, contents: list[list[int]], capacity: int = 8, seed: int = 0) -> list:
    """The first len(contents) actors, replica i holding contents[i] (RNG seed seed + i)."""
    used = handles[: len(contents)]
    ray.get(
        [
            h.reset.remote(c, capacity, seed + i)
            for i, (h, c) in enumerate(zip(used, contents, strict=True))
        ]
    )
    return used


def save(folder: str, components: dict) -> None:
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder))
    for name, handles in components.items():
        coord.register(name, handles)
    asyncio.run(coord.save(1))
    coord.close()


def load(folder: str, components: dict, **load_kw):
    """`components`: name -> handles or (handles, register keyword arguments)."""
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder))
    try:
        for name, spec in components.items():
            handles, kw = spec if isinstance(spec, tuple) else (spec, {})
            coord.register(name, handles, **kw)
        return asyncio.run(coord.load(**load_kw))
    finally:
        coord.close()


def items_of(handles) -> list[list[int]]:
    return [items for items, _ in ray.get([h.get.remote() for h in handles])]


def test_2_to_3_with_registered_rule_through_prepare_and_apply(pool, tmp_path, caplog):
    folder = str(tmp_path)
    old = fill(pool[Buffer], SAVED)
    save(folder, {"replay": old})
    saved_draws = ray.get([h.draw.remote() for h in old])  # each stream's next number
    new = fill(pool[Buffer], [FRESH] * 3, seed=99)
    with caplog.at_level(logging.WARNING, logger="forge_ckpt"):
        assert load(folder, {"replay": (new, {"reshard": concat_split})}).step == 1
    assert items_of(new) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    obs = torch.cat([o for _, o in ray.get([h.get.remote() for h in new])])
    assert torch.equal(obs, torch.arange(8.0))  # tensors concatenated and split exactly
    # replicas 0, 1 continue saved 0, 1's streams; the added replica 2 draws from streams
    # derived from saved replica 0's (rng.derive), not from a copy of them
    draws = ray.get([h.draw.remote() for h in new])
    assert draws[:2] == saved_draws and draws[2] not in saved_draws
    assert "replay: replicas changed: checkpoint=2, current=3; resharded by concat_split" in (
        caplog.text
    )
    assert "replay: holds 3 items" in caplog.text  # validate_state_dict saw the new state


def test_3_to_1_with_class_hook(pool, tmp_path):
    folder = str(tmp_path)
    save(folder, {"replay": fill(pool[HookBuffer], [[0, 1], [2], [3, 4, 5]])})
    new = fill(pool[HookBuffer], [FRESH])
    load(folder, {"replay": new})  # no rule given: HookBuffer.reshard_states runs remotely
    assert items_of(new) == [[0, 1, 2, 3, 4, 5]]


def test_plain_actor_reshards_through_load_state_dict(pool, tmp_path):
    folder = str(tmp_path)
    save(folder, {"replay": fill(pool[PlainBuffer], SAVED)})
    new = fill(pool[PlainBuffer], [FRESH] * 3)
    load(folder, {"replay": (new, {"reshard": concat_split})})
    assert items_of(new) == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_no_rule_names_component_counts_and_remedy(pool, tmp_path):
    folder = str(tmp_path)
    save(folder, {"replay": fill(pool[Buffer], SAVED)})
    new = fill(pool[Buffer], [FRESH] * 4)
    with pytest.raises(CheckpointMismatchError) as err:
        load(folder, {"replay": new})
    text = str(err.value)
    assert "replay: replicas changed: checkpoint=2, current=4" in text
    assert "reshard=rule" in text and "reshard_states(states, replicas)" in text
    assert items_of(new) == [FRESH] * 4


def test_failing_rule_names_component_and_changes_nothing(pool, tmp_path):
    folder = str(tmp_path)
    buffers = pool[Buffer]
    save(folder, {"replay": fill(buffers, SAVED), "other": fill(buffers[2:], [[42]])})

    def broken(states, replicas):
        raise ValueError("buffers disagree")

    fill(buffers, [FRESH] * 4)
    new, other = buffers[:3], buffers[3:]
    with pytest.raises(CheckpointMismatchError) as err:
        load(folder, {"other": other, "replay": (new, {"reshard": broken})})
    assert "replay: resharding rule " in str(err.value)
    assert "broken failed (checkpoint=2 replicas, current=3): ValueError: buffers disagree" in (
        str(err.value)
    )
    assert items_of(buffers) == [FRESH] * 4

    # a class hook that raises inside the actor (the capacities differ) is reported the same way
    hooks = pool[HookBuffer]
    fill(hooks, SAVED)
    fill(hooks[1:], SAVED[1:], capacity=9)
    save(str(tmp_path / "b"), {"replay": hooks[:2]})
    new = fill(hooks, [FRESH])
    with pytest.raises(CheckpointMismatchError, match=r"replay: resharding rule HookBuffer"):
        load(str(tmp_path / "b"), {"replay": new})
    assert items_of(new) == [FRESH]


def test_refused_resharded_state_changes_no_actor(pool, tmp_path):
    """The resharded states go through validate_state_dict and the two phases: one new replica
    refusing its state leaves every replica and every other component as it was."""
    folder = str(tmp_path)
    buffers = pool[Buffer]
    save(folder, {"replay": fill(buffers, SAVED), "other": fill(buffers[2:], [[42]])})
    fill(buffers, [FRESH] * 4)
    fill(buffers[2:], [FRESH], capacity=9)  # replica 2 will refuse its state
    new, other = buffers[:3], buffers[3:]
    with pytest.raises(CheckpointMismatchError, match="capacity changed: checkpoint=8, current=9"):
        load(folder, {"other": other, "replay": (new, {"reshard": concat_split})})
    assert items_of(buffers) == [FRESH] * 4


def test_new_and_gone_components_need_an_explicit_choice(pool, tmp_path, caplog):
    folder = str(tmp_path)
    buffers = pool[Buffer]
    save(folder, {"replay": fill(buffers, SAVED), "gone": fill(buffers[2:], [[42]])})
    fill(buffers, [FRESH] * 3)
    replay, added = buffers[:2], buffers[2:3]
    with pytest.raises(CheckpointMismatchError) as err:
        load(folder, {"replay": replay, "added": added})
    text = str(err.value)
    assert "gone: in the checkpoint (step 1) but not registered" in text
    assert "load(exclude=['gone'])" in text
    assert "added: registered but not in the checkpoint (step 1)" in text
    assert "register('added', ..., optional=True)" in text
    assert items_of(buffers[:3]) == [FRESH] * 3

    with caplog.at_level(logging.WARNING, logger="forge_ckpt"):
        load(folder, {"replay": replay, "added": (added, {"optional": True})}, exclude=["gone"])
    assert items_of(replay) == SAVED and items_of(added) == [FRESH]
    assert "added: not in step 1; keeps its fresh state" in caplog.text

    # allow_mismatch=True loads what it can (logged), never a KeyError
    fill(buffers, [FRESH] * 3)
    load(folder, {"replay": replay, "added": added}, allow_mismatch=True)
    assert items_of(replay) == SAVED and items_of(added) == [FRESH]
