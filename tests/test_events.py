"""Checkpoint events: one record per save and load, to `CheckpointConfig.on_event` and the
`forge_ckpt.coordination.events` logger, with the step, tier, bytes, timings and outcome that happened."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys

import pytest
import ray

from forge_ckpt import CheckpointConfig, CheckpointCoordinator, CheckpointSaveError
from forge_ckpt.coordination.events import CheckpointEvent
from forge_ckpt.steps import layout

sys.path.insert(0, os.path.dirname(__file__))
from crash_actors import Sampler  # noqa: E402


def test_save_failed_save_and_load_events(ray_local, tmp_path, caplog):
    folder = str(tmp_path / "ckpt")
    events: list[CheckpointEvent] = []

    async def run():
        coord = CheckpointCoordinator(CheckpointConfig(folder=folder, on_event=events.append))
        sampler = Sampler.remote(1)
        coord.register("sampler", sampler)
        await coord.save(1)
        await coord.save(1)  # already committed: nothing written
        ray.kill(sampler)
        with pytest.raises(CheckpointSaveError):
            await coord.save(2)
        coord.register("sampler", Sampler.remote(2), replace=True)
        await coord.load()
        coord.close()

    with caplog.at_level(logging.INFO, logger="forge_ckpt.coordination.events"):
        asyncio.run(run())
    nbytes = layout.read_committed(folder, 1).nbytes
    assert [(e.kind, e.step, e.tier, e.outcome) for e in events] == [
        ("save", 1, "durable", "committed"),
        ("save", 1, "durable", "skipped"),
        ("save", 2, "durable", "failed"),
        ("load", 1, "durable", "loaded"),
    ]
    saved, skipped, failed, loaded = events
    assert saved.nbytes == loaded.nbytes == nbytes > 400_000 and skipped.nbytes == 0
    assert set(saved.components) == {"sampler"} and 0 < saved.components["sampler"]
    assert 0 < saved.blocked_s <= saved.seconds  # sync: the caller waits for the commit
    assert failed.error is not None and "sampler" in failed.error and failed.nbytes == 0
    logged = [
        json.loads(r.getMessage())
        for r in caplog.records
        if r.name == "forge_ckpt.coordination.events"
    ]
    assert logged == [e.to_dict() for e in events]
    assert all(
        r.event["kind"] for r in caplog.records if r.name == "forge_ckpt.coordination.events"
    )


def test_async_save_event_comes_when_committed(ray_local, tmp_path):
    events: list[CheckpointEvent] = []

    def broken(event: CheckpointEvent) -> None:  # a dashboard that fails never fails a save
        events.append(event)
        raise RuntimeError("dashboard down")

    async def run():
        with pytest.warns(FutureWarning, match="is deprecated and now means 'deferred'"):
            config = CheckpointConfig(folder=str(tmp_path), async_mode="async", on_event=broken)
        assert config.async_mode == "deferred"  # the old name still runs, as the new mode
        coord = CheckpointCoordinator(config)
        coord.register("sampler", Sampler.remote(1))
        result = await coord.save(5)
        assert not result.committed
        await coord.wait()
        assert await coord.load() is not None
        coord.close()

    asyncio.run(run())
    save, load = events
    assert (save.kind, save.step, save.outcome, load.kind) == ("save", 5, "committed", "load")
    assert 0 < save.blocked_s < save.seconds and save.nbytes > 400_000


def test_on_event_is_for_code_only(tmp_path):
    with pytest.raises(ValueError, match="on_event must be a callable"):
        CheckpointConfig.from_dict({"folder": str(tmp_path), "on_event": "print"})
