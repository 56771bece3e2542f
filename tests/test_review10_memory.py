"""Review 10 with the memory tier (the simulation's harness: virtual time, the real tier and
holders): a landed memory save due to be persisted whose reply was lost is owed; a wait()
cancelled while it looked (A), or aclose() raising the save's failure first (C), left it
never pinned nor persisted, and close() took it with the holders (I1)."""

from __future__ import annotations

import asyncio
import errno
from typing import Any

import pytest
from test_sim_memory import Job, world  # noqa: F401

from forge_ckpt import CheckpointSaveError
from forge_ckpt.coordination import follow_ups
from forge_ckpt.steps import commit, layout


def test_a_cancelled_wait_loses_a_landed_memory_step(world, monkeypatch):  # noqa: F811
    a = Job(world, "jobA", durable_every=1)
    assert a.coord.tier is not None and a.run(a.coord.save(1)).committed
    a.run(a.coord.wait())
    real, seen = commit.commit_step, []

    def reply_lost(store: Any, manifest: Any, *args: Any) -> Any:
        out = real(store, manifest, *args)
        if manifest.step == 2 and store is a.coord.tier.store and not seen:
            seen.append(layout.committed_steps(store))
            raise OSError(errno.EIO, "reply lost (test)")
        return out

    monkeypatch.setattr(commit, "commit_step", reply_lost)
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        a.run(a.coord.save(2))
    owed = [m.step for m, *_ in a.coord._follow_ups.owed]
    look, tasks = follow_ups.committed_as, []

    def deadline_meanwhile(store: Any, manifest: Any) -> bool:
        tasks[0].cancel()  # the caller's deadline fires while the look runs
        return look(store, manifest)

    monkeypatch.setattr(follow_ups, "committed_as", deadline_meanwhile)
    tasks.append(a.start(a.coord.wait()))
    with pytest.raises(asyncio.CancelledError):
        world.loop.run_until_complete(tasks[0])
    monkeypatch.setattr(follow_ups, "committed_as", look)
    left = [m.step for m, *_ in a.coord._follow_ups.owed]
    a.run(a.coord.aclose())
    world.loop.run_until_complete(asyncio.sleep(1.0))  # the cancelled look's thread ends
    b = Job(world, "jobB")
    got = b.run(b.coord.load())
    durable = b.coord.steps()
    b.coord.close()
    print(
        f"\ncommitted memory steps as step 2 landed: {seen[0]}; owed {owed}, after the "
        f"cancelled wait() {left}; durable after aclose() {durable}; next job loads "
        f"step {got and got.step}"
    )
    assert 2 in durable, "committed memory step 2 was never persisted and is gone"


def test_aclose_drops_a_landed_memory_step(world, monkeypatch):  # noqa: F811
    a = Job(world, "jobA", durable_every=1, async_mode="deferred")
    assert a.coord.tier is not None
    a.run(a.coord.save(1))
    a.run(a.coord.wait())  # step 1: in memory and persisted
    real, lost = commit.commit_step, []

    def reply_lost(store: Any, manifest: Any, *args: Any) -> Any:
        out = real(store, manifest, *args)
        if manifest.step == 2 and store is a.coord.tier.store and not lost:
            lost.append(layout.committed_steps(store))  # what readers count now
            raise OSError(errno.EIO, "reply lost (test)")
        return out

    monkeypatch.setattr(commit, "commit_step", reply_lost)
    a.run(a.coord.save(2))
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        a.run(a.coord.aclose())
    in_memory = lost[0]
    b = Job(world, "jobB")
    got = b.run(b.coord.load())
    durable = b.coord.steps()
    b.coord.close()
    print(
        f"\ncommitted memory steps as step 2 landed: {in_memory}; after it, durable {durable}; "
        f"the next job loads step {got and got.step} ({got and got.tier})"
    )
    assert 2 in durable, "committed memory step 2 was never persisted and is gone"
