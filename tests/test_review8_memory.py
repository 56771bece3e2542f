"""Review 8: the owed follow-up of a memory commit (6e21956) against load()'s order. `_settle`
runs `_quiesce_calls` before it settles the tier (review 7's fix), but `_load` runs it a second
time, in `_quiesce`, after the tier was settled: an owed entry that the first look could not
decide (one storage error) is decided by the second, and the persist its follow-up starts
escapes the load again (review 7's escape, back through a transient fault).

One node's local Ray; holders keep one copy (`memory_copies=1`)."""

from __future__ import annotations

import asyncio
import errno
import threading
from typing import Any

import pytest
from _owed_faults import failing_looks
from _persist_holds import Counter

from forge_ckpt import CheckpointConfig, CheckpointCoordinator, CheckpointSaveError
from forge_ckpt.memory import cluster
from forge_ckpt.memory.store import MemoryStorage
from forge_ckpt.steps import commit

LATE_S = 5.0  # a hold that only the code under test should end earlier


@pytest.fixture(scope="module")
def counter(ray_local):
    return Counter.remote()


async def test_an_owed_persist_decided_by_the_loads_second_look_escapes_it(
    counter, tmp_path, monkeypatch
):
    """save(2)'s memory commit lands, its reply is lost (owed). load(step=1): the first look
    (in `_settle`, before the tier is settled) fails once; the second (in `_quiesce`, after)
    finds step 2 committed and starts its persist, which the load does not wait for: the
    old branch's step 2 is persisted beside the rolled-back job (its durable commit is held
    until the load returned, or LATE_S)."""
    coord = CheckpointCoordinator(CheckpointConfig(folder=str(tmp_path / "ckpt"),
                                  memory_every=1, durable_every=1, memory_copies=1))  # fmt: skip
    coord.register("counter", counter)
    await counter.set.remote(1)
    await coord.save(1)
    await coord.wait()
    real_commit, order, loaded, lost = commit.commit_step, [], threading.Event(), []

    def commit_step(store: Any, manifest: Any, *args: Any) -> Any:
        if store is coord.store and manifest.step == 2:
            loaded.wait(LATE_S)
            order.append("persist of step 2 commits")
        out = real_commit(store, manifest, *args)
        if isinstance(store, MemoryStorage) and manifest.step == 2 and not lost:
            lost.append(2)
            raise OSError(errno.EIO, "reply lost (test)")
        return out

    monkeypatch.setattr(commit, "commit_step", commit_step)
    await counter.set.remote(2)
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        await coord.save(2)
    failing_looks(monkeypatch, 1)
    result = await coord.load(step=1)
    order.append("load(step=1) returned")
    in_flight = [t for t in coord.tier._chain if not t.done()]
    loaded.set()
    try:
        await asyncio.wait_for(coord.wait(), 60)
    except Exception as e:
        print(f"wait(): {e}")
    coord.close()
    print(f"order {order}; persists in flight after load(step=1): {len(in_flight)}")
    assert result is not None and result.step == 1
    assert not in_flight, f"{len(in_flight)} persist(s) still in flight after load() returned"
    assert order[0] != "load(step=1) returned" or len(order) == 1, f"escaped: {order}"


class _GcsDownOnce(cluster.RayCluster):
    """The real cluster seam, whose next node listing fails (the GCS restarting)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def nodes(self) -> list[str]:
        if self.fail:
            self.fail = False
            raise ConnectionError("GCS unavailable (test)")
        return super().nodes()


async def test_a_recovery_load_fails_on_an_owed_follow_ups_error(counter, tmp_path, monkeypatch):
    """save(2)'s memory commit lands, its reply is lost (owed). The recovery load() runs the
    owed follow-up (`_settle` -> `_quiesce_calls`), whose look for new nodes fails once (the
    GCS, a post-commit chore): the error is not caught there and load() raises it, where a
    load logs what a save left behind and loads the newest whole step (docs/protocol.md)."""
    seam = _GcsDownOnce()
    old = cluster.install(seam)
    try:
        coord = CheckpointCoordinator(CheckpointConfig(folder=str(tmp_path / "ckpt"),
                                      memory_every=1, durable_every=1, memory_copies=1))  # fmt: skip
        coord.register("counter", counter)
        await counter.set.remote(1)
        await coord.save(1)
        await coord.wait()
        real_commit, lost = commit.commit_step, []

        def commit_step(store: Any, manifest: Any, *args: Any) -> Any:
            out = real_commit(store, manifest, *args)
            if isinstance(store, MemoryStorage) and manifest.step == 2 and not lost:
                lost.append(2)
                raise OSError(errno.EIO, "reply lost (test)")
            return out

        monkeypatch.setattr(commit, "commit_step", commit_step)
        await counter.set.remote(2)
        with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
            await coord.save(2)
        coord.tier._checked_nodes = None  # the 2 s between looks for new nodes have passed
        seam.fail = True
        await counter.set.remote(-1)
        try:
            loaded: Any = await coord.load()
        except Exception as e:
            loaded = e
        n = await counter.get.remote()
        try:
            await asyncio.wait_for(coord.wait(), 60)
        except Exception as e:
            print(f"wait(): {e}")
        coord.close()
    finally:
        cluster.install(old)
    print(f"load() -> {loaded!r}; n={n}")
    assert not isinstance(loaded, Exception), f"the recovery load raised: {loaded!r}"
    assert loaded is not None and loaded.step == 2 and n == 2
