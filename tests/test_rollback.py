"""Rollback branches under storage faults (issue 22; both found by the simulation, seeds 5428
and 3299 of an earlier code): an abandoned step must stay abandoned whatever fails around it.

Plain actors answering through `.remote()` and a local folder whose chosen storage call fails
once: no Ray, no timing."""

from __future__ import annotations

from typing import Any

import pytest
from _held_storage import (
    fail,
    held_config,
    held_rules,  # noqa: F401 (a fixture)
)

from forge_ckpt import CheckpointCoordinator, CheckpointSaveError
from forge_ckpt.steps import layout

pytestmark = pytest.mark.usefixtures("held_rules")


class _Call:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        async def run() -> Any:
            return self.fn(*args)

        return run()


class Plain:
    """An actor with only state_dict/load_state_dict (the driver does its I/O)."""

    def __init__(self) -> None:
        self.v = 0
        self.state_dict = _Call(lambda: {"v": self.v})
        self.load_state_dict = _Call(self._load)

    def _load(self, state: dict) -> None:
        self.v = state["v"]


def open_job(folder: Any, keep_last: int) -> tuple[CheckpointCoordinator, Plain]:
    coord = CheckpointCoordinator(held_config(folder, keep_last=keep_last))
    actor = Plain()
    coord.register("a", actor)
    return coord, actor


async def save(coord: CheckpointCoordinator, actor: Plain, step: int, branch: str) -> None:
    actor.v = step * 10 + (1 if branch == "new" else 0)
    assert (await coord.save(step)).committed


async def test_an_abandoned_step_stays_abandoned_when_retention_removes_its_record(tmp_path):
    """Seed 5428: the abandoned step 6 could not be removed after the new branch's first
    commit; retention later removed that first step, whose manifest was the only record of
    the abandonment, and step 6 came back as the newest step (load() returned it, save(6)
    was refused). Retention now retires abandoned steps before it removes anything."""
    coord, actor = open_job(tmp_path, keep_last=10)
    for step in range(1, 7):
        await save(coord, actor, step, "old")
    assert (await coord.load(step=2)).step == 2
    coord.config.keep_last = 2
    fail("delete", "step-6/COMMIT", times=2)  # its removal after the commit fails, retried too
    await save(coord, actor, 3, "new")
    assert layout.committed_steps(str(tmp_path)) == [1, 2, 3, 6]  # 6: there, abandoned
    await save(coord, actor, 4, "new")
    await save(coord, actor, 5, "new")  # retention removes step 3
    assert layout.committed_steps(str(tmp_path)) == [4, 5]
    loaded = await coord.load()
    assert loaded.step == 5 and actor.v == 51
    await save(coord, actor, 6, "new")  # the abandoned step's number is free
    coord.close()
    again, actor = open_job(tmp_path, keep_last=2)
    assert (await again.load()).step == 6 and actor.v == 61
    again.close()


async def test_a_step_of_unknown_outcome_is_abandoned_by_a_rollback(tmp_path):
    """Seed 3299: step 4's commit failed writing the lease's record (outcome unknown), so a
    rollback to step 2 did not list it as abandoned; the next record written (the new
    branch's step 3) recorded step 4 as well, and it came back as the newest step. A
    rollback now abandons every step newer than its point that has a marker."""
    coord, actor = open_job(tmp_path, keep_last=10)
    for step in range(1, 4):
        await save(coord, actor, step, "old")
    fail("replace", layout.LEASE)  # the record of step 4 is never written
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        await save(coord, actor, 4, "old")
    assert (await coord.load(step=2)).step == 2
    await save(coord, actor, 3, "new")
    assert layout.committed_steps(str(tmp_path)) == [1, 2, 3]
    loaded = await coord.load()
    assert loaded.step == 3 and actor.v == 31
    coord.close()
    again, actor = open_job(tmp_path, keep_last=10)
    assert (await again.load()).step == 3 and actor.v == 31
    again.close()


async def test_a_half_copy_set_aside_never_blocks_the_next_start(tmp_path):
    """Seed 751: on S3 a move is copies then deletes. Putting a set-aside step back failed
    after the copy's marker left and before its other objects did; the branch went on and
    retired that step. Every later start then failed reading the copy's marker, so the
    folder could never be opened again. A copy without a marker is a half copy: dropped."""
    coord, actor = open_job(tmp_path, keep_last=10)
    for step in range(1, 4):
        await save(coord, actor, step, "old")
    coord.close()
    half = tmp_path / "replaced" / "step-5"  # what the failed move left: files, no marker
    (half / "actors").mkdir(parents=True)
    (half / "actors" / "a.0.msgpack").write_bytes(b"x" * 10)
    (half / layout.MANIFEST).write_bytes(b"{}")
    again, actor = open_job(tmp_path, keep_last=10)
    assert not half.exists()
    assert (await again.load()).step == 3 and actor.v == 30
    await save(again, actor, 4, "old")
    again.close()
