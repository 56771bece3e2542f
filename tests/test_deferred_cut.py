"""The stall-free cut (`async_mode="deferred"`): `save()` returns once every snapshot call is
submitted, the trainer copies its state while the loop goes on, and its next optimizer step
waits for that copy; the step that is saved is still exactly the state at `save()`.

Real gloo process groups (world 2, FSDP2: each rank holds other shards), real TorchTitan, real
Ray actors. The copy is held until the training step waits for it, so that the step
certainly arrives while it runs (no timing is asserted beyond that the step had to wait).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import ray
import torch

sys.path.insert(0, os.path.dirname(__file__))
import _trainer_model  # noqa: E402
from test_trainer import assert_same, call  # noqa: E402

from forge_ckpt import (  # noqa: E402
    Checkpointable,
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointSaveError,
    immutable,  # noqa: E402
    serialization,
)
from forge_ckpt.trainer.ranks import spawn_trainer_ranks  # noqa: E402

deferred = pytest.mark.asyncio(loop_scope="module")


@ray.remote(num_cpus=0)
class Cursor(Checkpointable):
    """A data position that every driver call moves, and immutable episodes it keeps."""

    def __init__(self) -> None:
        self.position = 0
        self.episodes: list[np.ndarray] = []
        self.fail = False

    def advance(self) -> int:
        self.position += 1
        self.episodes.append(np.full(4, self.position, dtype=np.int64))
        return self.position

    def fail_next_snapshot(self) -> None:
        self.fail = True

    def state_dict(self) -> dict:
        if self.fail:
            self.fail = False
            raise ValueError("cursor index out of range")
        return {"position": self.position, "episodes": immutable(list(self.episodes))}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]
        self.episodes = [np.array(e) for e in state["episodes"]]

    def state(self) -> dict:
        return {"position": self.position, "episodes": [e.tolist() for e in self.episodes]}


@pytest.fixture(scope="module")
def rank_actor(ray_local):
    ray_local.cloudpickle.register_pickle_by_value(_trainer_model)
    return ray_local.remote(num_cpus=0)(_trainer_model.TrainerRank)


def ranks_of(rank_actor, seed: int) -> list:
    ranks = spawn_trainer_ranks(rank_actor, 2)
    call(ranks, "setup", seed)
    return ranks


@deferred
async def test_deferred_save_returns_before_the_copy_and_the_step_waits_for_it(
    rank_actor, tmp_path
):
    ranks, cursor = ranks_of(rank_actor, 0), Cursor.remote()
    call(ranks, "train", 2)
    await cursor.advance.remote()
    config = CheckpointConfig(folder=str(tmp_path), async_mode="deferred")
    coord = CheckpointCoordinator(config)
    coord.set_trainer(ranks)
    coord.register("cursor", cursor)
    call(ranks, "hold_snapshot_copies")
    at_save = call(ranks, "summary")
    cursor_at_save = await cursor.state.remote()

    result = await coord.save(3)
    assert not result.committed and coord.steps() == []  # returned before the copy finished
    call(ranks, "train", 1)  # its optimizer step must wait for the copy
    await cursor.advance.remote()  # runs after the cursor's snapshot (Ray's call order)
    assert min(call(ranks, "stall_s")) > 0
    done = await coord.wait()
    assert done is not None and done.committed and coord.steps() == [3]

    fresh, cursor2 = ranks_of(rank_actor, 7), Cursor.remote()
    coord.set_trainer(fresh)
    coord.register("cursor", cursor2, replace=True)
    loaded = await coord.load()
    assert loaded is not None and loaded.step == 3
    for rank, (want, got) in enumerate(zip(at_save, call(fresh, "summary"), strict=True)):
        assert_same(want, got, f"rank {rank}")
    assert await cursor2.state.remote() == cursor_at_save
    await coord.aclose()
    for r in [*ranks, *fresh]:
        ray.kill(r)


@deferred
async def test_a_failed_deferred_snapshot_is_raised_by_wait_and_commits_nothing(
    ray_local, tmp_path
):
    cursor = Cursor.remote()
    coord = CheckpointCoordinator(CheckpointConfig(folder=str(tmp_path), async_mode="deferred"))
    coord.register("cursor", cursor)
    await cursor.advance.remote()
    await coord.save(1)
    await coord.wait()
    await cursor.fail_next_snapshot.remote()
    await coord.save(2)  # returns: the failure is in the snapshot it only submitted
    with pytest.raises(CheckpointSaveError, match="cursor index out of range"):
        await coord.wait()
    assert coord.steps() == [1]
    assert not any(p.startswith("step-2") for p in os.listdir(tmp_path))
    await coord.save(2)  # the next save works
    await coord.aclose()
    assert coord.steps() == [1, 2]


def test_immutable_parts_are_referenced_not_copied_and_load_as_plain_values(tmp_path):
    mutable = np.arange(4, dtype=np.float32)
    frozen = torch.arange(4, dtype=torch.float32)
    state = {"scratch": mutable, "entries": immutable([frozen])}
    snap = serialization.snapshot(state, name="replay", copy=True)
    mutable += 100  # copied: the snapshot keeps the values at the cut
    frozen += 100  # declared immutable and still changed: the snapshot sees it (not copied)
    snap.write(str(tmp_path / "replay.msgpack"), "replay.msgpack")
    loaded = serialization.load(str(tmp_path / "replay.msgpack"))
    np.testing.assert_array_equal(loaded["scratch"], np.arange(4, dtype=np.float32))
    assert isinstance(loaded["entries"], list)  # the wrapper is not part of the format
    assert torch.equal(loaded["entries"][0], torch.arange(4, dtype=torch.float32) + 100)
