"""close() and register() while a background save runs (issue 22, items 1 and 11, and the
review's close-during-retention): a commit in flight is never cut or undone, nothing is
written after the lease is released, and a component registered meanwhile is not part of
the save that had already begun. Plain actors answering through `.remote()` and a local
folder whose storage calls a test can hold on a threading.Event: no Ray, no timing."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from typing import Any

import pytest
from _held_storage import LOG as WRITES
from _held_storage import (
    held_config,
    held_rules,  # noqa: F401 (a fixture)
    hold,
)

from forge_ckpt import CheckpointConfig, CheckpointCoordinator
from forge_ckpt.steps import layout

pytestmark = pytest.mark.usefixtures("held_rules")


class _Call:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> asyncio.Future:
        async def run() -> Any:
            return self.fn(*args)

        return asyncio.ensure_future(run())


class Plain:
    """An actor with only state_dict/load_state_dict (the driver does its I/O)."""

    def __init__(self, v: int = 0) -> None:
        self.v = v
        self.state_dict = _Call(lambda: {"v": self.v})
        self.load_state_dict = _Call(self._load)

    def _load(self, state: dict) -> None:
        self.v = state["v"]


def config(folder: str, **kw: Any) -> CheckpointConfig:
    return held_config(folder, async_mode="deferred", **kw)


def lease(folder: str) -> dict:
    with open(os.path.join(folder, layout.LEASE)) as f:
        return json.load(f)


async def test_close_during_the_commit_keeps_the_step_and_releases_after_it(tmp_path):
    """Item 1: close() while the background save writes its COMMIT. The commit finishes, the
    step stays committed (it was removed: the cancelled task's abort ran after the commit),
    and the lease is released only after the commit (nothing is written after it)."""
    coord = CheckpointCoordinator(config(tmp_path))
    coord.register("a", Plain(1))
    held = hold("create", "step-1/COMMIT")
    await coord.save(1)
    await held.reached()
    coord.close()  # never blocks
    assert not lease(tmp_path)["released"]  # the commit in flight still holds it
    held.go.set()
    with pytest.raises((asyncio.CancelledError, Exception)):
        await coord._pending  # type: ignore[misc]
    await asyncio.to_thread(_wait_released, str(tmp_path))
    release = WRITES.index(("publish", layout.LEASE)) if ("publish", layout.LEASE) in WRITES else -1
    assert release == -1 or all(layout.LEASE in p for _, p in WRITES[release:])
    assert layout.committed_steps(str(tmp_path)) == [1]
    again = CheckpointCoordinator(config(tmp_path))
    again.register("a", actor := Plain(0))
    assert (await again.load()).step == 1 and actor.v == 1
    again.close()


def _wait_released(folder: str) -> None:
    """A condition, bounded: the lease says released."""
    for _ in range(60_000):
        if lease(folder)["released"]:
            return
        threading.Event().wait(0.001)
    raise AssertionError("the lease was never released")


async def test_register_during_a_background_save_is_not_part_of_it(tmp_path):
    """Item 11: a component registered while a background save runs joins the next save,
    not that one (it broke the save with a KeyError: the manifest was built from the
    components registered at commit time)."""
    coord = CheckpointCoordinator(config(tmp_path))
    coord.register("a", Plain(1))
    held = hold("create", "step-1/manifest.json")
    await coord.save(1)
    await held.reached()
    coord.register("late", Plain(7))
    held.go.set()
    result = await coord.wait()
    assert result is not None and result.committed
    assert set(layout.read_committed(str(tmp_path), 1).components) == {"a"}
    await coord.save(2)
    await coord.wait()
    assert set(layout.read_committed(str(tmp_path), 2).components) == {"a", "late"}
    coord.close()


async def test_close_during_retention_releases_only_after_it(tmp_path):
    """The review's break 4: close() while retention removes an old step. Retention ends
    under the lease; the release comes after its last write."""
    coord = CheckpointCoordinator(config(tmp_path, keep_last=1))
    coord.register("a", Plain(1))
    await coord.save(1)
    await coord.wait()
    held = hold("delete", "step-1/COMMIT")
    await coord.save(2)
    await held.reached()
    coord.close()
    assert not lease(tmp_path)["released"]
    held.go.set()
    with pytest.raises((asyncio.CancelledError, Exception)):
        await coord._pending  # type: ignore[misc]
    await asyncio.to_thread(_wait_released, str(tmp_path))
    last = max(i for i, (_, p) in enumerate(WRITES) if not p.endswith(layout.LEASE))
    releases = [i for i, (op, p) in enumerate(WRITES) if p.endswith(layout.LEASE)]
    assert releases and releases[-1] > last
    assert layout.committed_steps(str(tmp_path)) == [2]
