"""Persisting memory steps to the durable folder on the 3-node test cluster, with each
holder's persist held at a gate the test opens (a file on the machine's disk, shared by every
node; `cluster_util.hold_persist`), so nothing here waits on timing:

- a holder that is persisting still takes a memory save (none counts as dead);
- a step waiting to be persisted stays in memory (pinned) through later saves;
- a failed persist is raised by the next wait() even after a later persist succeeded;
- the node whose holder is persisting is lost: load() loads the newest whole step;
- close() while the durable commit runs never removes the committed step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cluster_util as cu  # noqa: E402

from forge_ckpt import CheckpointCoordinator, CheckpointError, committed_steps  # noqa: E402
from forge_ckpt.steps import layout  # noqa: E402

nodes = pytest.fixture(scope="module", name="nodes")(cu.driving_cluster)
config = cu.memory_config


def hold(coord: CheckpointCoordinator, gate: str, step: int) -> None:
    """Every holder of the run holds its persist of `step` at `gate` (cluster_util)."""
    assert coord.tier is not None
    os.makedirs(gate, exist_ok=True)
    for name, _ in coord.tier.holders:
        cu.hold_persist(coord.tier.store.handle(name), gate, step)


@contextlib.contextmanager
def opened_at_exit(gate: str):
    """Whatever the test does, held persists end (else holders stay busy for later tests)."""
    try:
        yield
    finally:
        os.makedirs(gate, exist_ok=True)
        open(os.path.join(gate, "open"), "w").close()


async def test_a_holder_that_is_persisting_still_takes_saves(nodes, s3_folder, tmp_path):
    """While every holder's persist of step 1 is held, a memory save of step 2 completes on
    all three holders (none counts as dead); the persist then finishes."""
    coord = CheckpointCoordinator(config(s3_folder.url, s3_folder.options, durable_every=100))
    actor = cu.Buffer.options(**cu.on("head")).remote(0)
    coord.register("dataset", actor)
    gate = str(tmp_path / "gate")
    hold(coord, gate, 1)
    try:
        with opened_at_exit(gate):
            await coord.save(1, durable=True)
            await asyncio.to_thread(cu.entered, gate)
            await asyncio.wait_for(coord.save(2, durable=False), 60)
            has = await asyncio.to_thread(coord.tier.store.on_all, "has", ["step-2/COMMIT"])
            assert [flags for _, flags in has] == [[True]] * 3
            assert committed_steps(s3_folder.url, s3_folder.options) == []
        await coord.wait()
        assert committed_steps(s3_folder.url, s3_folder.options) == [1]
    finally:
        coord.close()


async def test_a_step_waiting_to_be_persisted_stays_in_memory(nodes, s3_folder, tmp_path):
    """memory_keep=1: steps 2 and 3 are saved while step 1's persist is held; step 1 stays
    (pinned) and is persisted whole; once persisted, retention drops it."""
    cfg = config(s3_folder.url, s3_folder.options, durable_every=100, memory_keep=1)
    coord = CheckpointCoordinator(cfg)
    actor = cu.Buffer.options(**cu.on("head")).remote(0)
    coord.register("dataset", actor)
    gate = str(tmp_path / "gate")
    hold(coord, gate, 1)
    try:
        with opened_at_exit(gate):
            await coord.save(1, durable=True)
            await asyncio.to_thread(cu.entered, gate)
            for step in (2, 3):
                await actor.step.remote()
                await coord.save(step, durable=False)
            assert coord.tier.steps() == [1, 3]
        await coord.wait()
        assert committed_steps(s3_folder.url, s3_folder.options) == [1]
        await coord.save(4, durable=False)
        assert coord.tier.steps() == [4]
    finally:
        coord.close()


async def test_a_failed_persist_is_raised_after_a_later_one(nodes, s3_folder, tmp_path, caplog):
    """Step 1's persist fails; step 2's starts (and succeeds) after it: the next wait()
    still raises step 1's failure, once, as the log line says. Each save and persist emits
    its event (forge_ckpt.coordination.events)."""
    events: list[Any] = []
    cfg = config(s3_folder.url, s3_folder.options, durable_every=1, on_event=events.append)
    coord = CheckpointCoordinator(cfg)
    actor = cu.Buffer.options(**cu.on("head")).remote(0)
    coord.register("dataset", actor)
    gate = str(tmp_path / "gate")
    hold(coord, gate, 1)
    open(os.path.join(gate, "fail"), "w").close()
    try:
        with caplog.at_level(logging.ERROR, logger="forge_ckpt"):
            await coord.save(1)
            await coord.save(2)  # waits for step 1's persist, then starts step 2's
            with pytest.raises(CheckpointError, match="persisting memory step 1") as e:
                await coord.wait()
        assert "the test's gate" in str(e.value)
        assert "persisting memory step 1 to the durable folder failed" in caplog.text
        assert "the next wait() or aclose() raises it" in caplog.text
        assert await coord.wait() is None  # raised once, not again
        assert committed_steps(s3_folder.url, s3_folder.options) == [2]
        assert [(e.kind, e.step, e.tier, e.outcome) for e in events] == [
            ("save", 1, "memory", "committed"),
            ("persist", 1, "durable", "failed"),
            ("save", 2, "memory", "committed"),
            ("persist", 2, "durable", "committed"),
        ]
        assert events[3].nbytes == events[2].nbytes > 0 and "gate" in str(events[1].error)
    finally:
        coord.close()


async def test_a_node_lost_while_persisting_loads_the_newest_whole_step(
    nodes, s3_folder, tmp_path, caplog
):
    """Step 2 is being persisted (held) by the holder of one node; that node is lost: the
    persist fails, and load() logs it and loads memory step 2 from the copies left."""
    coord = CheckpointCoordinator(config(s3_folder.url, s3_folder.options, durable_every=1))
    actor = cu.Buffer.options(**cu.on("head")).remote(0)
    coord.register("dataset", actor)
    gate = str(tmp_path / "gate")
    try:
        with opened_at_exit(gate):
            await actor.step.remote()
            await coord.save(1)
            await coord.wait()
            hold(coord, gate, 2)
            await actor.step.remote()
            await coord.save(2)
            saved = (await actor.state_dict.remote())["history"]
            (persisting,) = await asyncio.to_thread(cu.entered, gate)
            name = {w.node_id: n for n, w in nodes.workers.items()}[persisting]
            await asyncio.to_thread(nodes.remove, name)
            await actor.step.remote()  # moves on: the load must bring it back
            with caplog.at_level(logging.WARNING, logger="forge_ckpt"):
                loaded = await coord.load()
        assert (loaded.step, loaded.tier) == (2, "memory")
        assert (await actor.state_dict.remote())["history"] == saved
        assert "persisting memory step 2" in caplog.text
        assert committed_steps(s3_folder.url, s3_folder.options) == [1]
    finally:
        coord.close()
        nodes.restore()


async def test_close_during_the_durable_commit_keeps_the_step(nodes, s3_folder):
    """A persist cancelled (close) while its durable commit runs: the commit finishes and the
    committed step keeps every file (it was removed under it before)."""
    coord = CheckpointCoordinator(config(s3_folder.url, s3_folder.options, durable_every=1))
    actor = cu.Buffer.options(**cu.on("head")).remote(0)
    coord.register("dataset", actor)
    entered, release, done = threading.Event(), threading.Event(), threading.Event()
    real = coord._committer.commit

    def gated_commit(manifest: layout.Manifest, store: Any = None) -> None:
        if store is not None:  # a memory commit
            return real(manifest, store)
        entered.set()
        release.wait(120)
        try:
            return real(manifest, store)
        finally:
            done.set()

    coord._committer.commit = gated_commit  # type: ignore[method-assign]
    try:
        await coord.save(1)
        assert await asyncio.to_thread(entered.wait, 120)
        task = coord.tier._persisting
        coord.tier.cancel()  # what close() does first
        await asyncio.wait([task])
        release.set()
        assert await asyncio.to_thread(done.wait, 120)
        assert committed_steps(s3_folder.url, s3_folder.options) == [1]
        manifest = layout.read_committed(coord.store, 1)
        for f in manifest.files:
            assert coord.store.size(f"step-1/{f.path}") == f.size, f.path
    finally:
        release.set()
        coord.close()


async def test_a_memory_save_behind_a_newer_durable_step_is_refused(nodes, s3_folder):
    """Issue 22, item 3: on a folder whose newest durable step is 10, save(1) is refused with
    the memory tier as without it (it was accepted, and retention then deleted the persisted
    copy by number while the next load() resumed step 10)."""
    coord = CheckpointCoordinator(config(s3_folder.url, s3_folder.options, durable_every=1))
    actor = cu.Buffer.options(**cu.on("head")).remote(0)
    coord.register("dataset", actor)
    try:
        await coord.save(10, durable=True)
        await coord.wait()
        assert committed_steps(s3_folder.url, s3_folder.options) == [10]
    finally:
        coord.close()
    coord = CheckpointCoordinator(config(s3_folder.url, s3_folder.options, durable_every=1))
    coord.register("dataset", actor)
    try:
        coord.tier.wipe()  # only the durable step 10 is left: the memory tier knows none
        with pytest.raises(CheckpointError, match="step 10 is newer"):
            await coord.save(1)
        assert committed_steps(s3_folder.url, s3_folder.options) == [10]
        assert (await coord.load()).step == 10
    finally:
        coord.close()
