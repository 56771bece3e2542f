"""CheckpointCoordinator with real Ray actors: round trip, RNG resume, errors, async, retention."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import time

import numpy as np
import pytest
import ray
import torch

from forge_ckpt import (
    Checkpointable,
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointCorruptError,
    CheckpointLockedError,
    CheckpointMismatchError,
    CheckpointSaveError,
    InvalidNameError,
)
from forge_ckpt.steps import layout

HANG_S = 300.0  # a hang's bound, never a speed's


@ray.remote
class Sampler(Checkpointable):
    """Draws from every kind of RNG stream and keeps what it drew."""

    def __init__(self, seed: int, size: int = 1000):
        self.py = random.Random(seed)
        self.np = np.random.default_rng(seed)
        self.tg = torch.Generator().manual_seed(seed)
        self.history: list[float] = []
        self.table = torch.zeros(size, dtype=torch.bfloat16)
        self.fail: str | None = None

    def rng_generators(self):
        return {"py": self.py, "np": self.np, "torch": self.tg}

    def step(self) -> list[float]:
        draws = [
            self.py.random(),
            float(self.np.random()),
            float(torch.rand(1, generator=self.tg)),
            random.random(),
            float(np.random.rand()),
            float(torch.rand(1)),
        ]
        self.history.append(sum(draws))
        self.table += torch.randn(self.table.shape, generator=self.tg).to(torch.bfloat16)
        return draws

    def state_dict(self):
        if self.fail == "raise":
            self.fail = None
            raise ValueError("replay index out of range")
        if self.fail is not None and self.fail.startswith("hang:"):
            hold, self.fail = self.fail.removeprefix("hang:"), None
            deadline = time.monotonic() + HANG_S
            while os.path.exists(hold) and time.monotonic() < deadline:
                time.sleep(0.01)  # hangs until the test removes `hold`
        return {"history": list(self.history), "table": self.table}

    def load_state_dict(self, state):
        self.history = list(state["history"])
        self.table = state["table"].clone()

    def get(self):
        return {"history": list(self.history), "table": self.table.clone()}

    def set_fail(self, mode):
        self.fail = mode


@ray.remote
class Stats:
    """A plain async actor: no mixin, its state passes through the driver."""

    def __init__(self):
        self.count = 0
        self.values = np.zeros(4)

    async def add(self, x: float):
        self.count += 1
        self.values += x

    async def state_dict(self):
        return {"count": self.count, "values": self.values}

    async def load_state_dict(self, state):
        self.count, self.values = state["count"], np.array(state["values"])

    async def get(self):
        return {"count": self.count, "values": self.values.copy()}


def config(tmp_path, **kw) -> CheckpointConfig:
    return CheckpointConfig(folder=str(tmp_path / "ckpt"), **kw)


async def build(cfg, seeds=(1, 2, 3)):
    sampler = Sampler.remote(seeds[0])
    replicas = [Sampler.remote(s) for s in seeds[1:]]
    stats = Stats.remote()
    coord = CheckpointCoordinator(cfg)
    coord.register("sampler", sampler)
    coord.register("buffer", replicas)
    coord.register("stats", stats)
    return coord, [sampler, *replicas], stats


async def run_steps(samplers, stats, n):
    out = []
    for _ in range(n):
        draws = await asyncio.gather(*(s.step.remote() for s in samplers))
        await stats.add.remote(sum(map(sum, draws)))
        out.append(draws)
    return out


def assert_state_equal(a, b):
    assert a["history"] == b["history"]
    assert torch.equal(a["table"].view(torch.int16), b["table"].view(torch.int16))


async def test_round_trip_and_rng_resume(ray_local, tmp_path):
    cfg = config(tmp_path)
    coord, samplers, stats = await build(cfg)
    await run_steps(samplers, stats, 3)
    res = await coord.save(3, extra={"policy_version": 3})
    assert res.committed and res.nbytes > 0 and set(res.seconds) == {"sampler", "buffer", "stats"}
    saved = [await s.get.remote() for s in samplers]
    saved_stats = await stats.get.remote()
    expected = await run_steps(samplers, stats, 2)  # the uninterrupted run
    coord.close()

    coord2, fresh, fresh_stats = await build(cfg, seeds=(7, 8, 9))  # other seeds: all restored
    loaded = await coord2.load()
    assert loaded.step == 3 and loaded.extra == {"policy_version": 3}
    for s, want in zip(fresh, saved, strict=True):
        assert_state_equal(await s.get.remote(), want)
    got_stats = await fresh_stats.get.remote()
    assert got_stats["count"] == saved_stats["count"]
    assert np.array_equal(got_stats["values"], saved_stats["values"])
    assert await run_steps(fresh, fresh_stats, 2) == expected  # every stream resumes exactly
    files = sorted(os.listdir(os.path.join(loaded.path, "actors")))
    named = [re.sub(r"\.g\d+s\d+\.msgpack$", ".msgpack", f) for f in files]  # (the attempt)
    assert named == ["buffer.0.msgpack", "buffer.1.msgpack", "sampler.0.msgpack", "stats.0.msgpack"]
    assert len({f.split(".")[-2] for f in files}) == 1  # one save attempt wrote them all
    coord2.close()


async def test_same_or_older_step_after_saves_of_this_coordinator(ray_local, tmp_path, caplog):
    """A save of a step newer than any this coordinator committed skips listing the folder;
    the same step again, or an older one, is still caught."""
    coord, _, _ = await build(config(tmp_path))
    await coord.save(2)
    await coord.save(4)
    assert (await coord.save(4)).committed and "step 4 is already committed" in caplog.text
    with pytest.raises(CheckpointSaveError, match="cannot save step 3: step 4 is newer"):
        await coord.save(3)
    assert (await coord.save(5)).committed and coord.steps() == [2, 4, 5]
    coord.close()


async def test_fresh_folder_loads_nothing(ray_local, tmp_path):
    coord, _, _ = await build(config(tmp_path))
    assert await coord.load() is None and coord.steps() == []
    coord.close()


async def test_replicas_come_back_to_their_index(ray_local, tmp_path):
    cfg = config(tmp_path)
    coord, samplers, stats = await build(cfg)
    await run_steps(samplers, stats, 1)
    await coord.save(1)
    saved = [await s.get.remote() for s in samplers[1:]]
    coord.close()
    coord2, fresh, _ = await build(cfg, seeds=(5, 6, 7))
    await coord2.load()
    for s, want in zip(fresh[1:], saved, strict=True):
        assert_state_equal(await s.get.remote(), want)
    assert saved[0]["history"] != saved[1]["history"]
    coord2.close()


async def test_actor_raises_then_next_save_works(ray_local, tmp_path):
    coord, samplers, stats = await build(config(tmp_path))
    await coord.save(1)
    await samplers[2].set_fail.remote("raise")
    with pytest.raises(CheckpointSaveError) as e:
        await coord.save(2)
    msg = str(e.value)
    assert "actor 'buffer' replica 1: ValueError: replay index out of range" in msg
    assert "step 1 is still the newest committed step" in msg
    assert coord.steps() == [1] and not os.path.exists(layout.step_dir(coord.config.folder, 2))
    assert (await coord.save(2)).committed and coord.steps() == [1, 2]
    coord.close()


async def test_dead_actor_names_it_and_replacement_works(ray_local, tmp_path):
    coord, samplers, stats = await build(config(tmp_path))
    await coord.save(1)
    ray.kill(samplers[0])
    with pytest.raises(CheckpointSaveError, match="actor 'sampler' replica 0: the actor died"):
        await coord.save(2)
    assert coord.steps() == [1]
    coord.register("sampler", Sampler.remote(11), replace=True)
    assert (await coord.save(2)).committed
    coord.close()


async def test_hanging_actor_times_out(ray_local, tmp_path):
    """A snapshot that hangs fails the save at `save_timeout_s`, naming the actor; the actor,
    woken later, finds no folder for its late write, and the next save commits. The hang is
    held on a file, so only it can time out (no other component, whatever the load)."""
    cfg = config(tmp_path, save_timeout_s=HANG_S)
    sampler = Sampler.remote(1)
    coord = CheckpointCoordinator(cfg)
    coord.register("sampler", sampler)
    await sampler.step.remote()
    await coord.save(1)
    hold = str(tmp_path / "hold")
    open(hold, "w").close()  # noqa: SIM115
    await sampler.set_fail.remote(f"hang:{hold}")
    cfg.save_timeout_s = 2  # the hang outlasts it whatever the machine's speed
    with pytest.raises(CheckpointSaveError, match="actor 'sampler' replica 0: TimeoutError"):
        await coord.save(2)
    assert os.path.exists(hold)  # the timeout ended the save, not the hang
    assert coord.steps() == [1]
    cfg.save_timeout_s = HANG_S
    os.remove(hold)
    await sampler.set_fail.remote(None)  # runs after the woken call's late write
    assert not os.path.exists(tmp_path / "ckpt" / "step-2")  # it found no folder
    assert (await coord.save(3)).committed and coord.steps() == [1, 3]
    coord.close()


async def test_storage_fault_in_actor(ray_local, tmp_path):
    cfg = config(tmp_path)
    coord = CheckpointCoordinator(cfg)
    coord.register("ok", Sampler.remote(1))
    coord.register(
        "full",
        Sampler.options(runtime_env={"env_vars": {"FORGE_CKPT_FAULT": "write:ENOSPC"}}).remote(2),
    )
    with pytest.raises(
        CheckpointSaveError, match="actor 'full' replica 0: OSError: .*No space left"
    ):
        await coord.save(1)
    assert coord.steps() == [] and layout.all_steps(cfg.folder) == []
    coord.close()


@pytest.mark.parametrize("fault", ["rename:EIO", "fsync:EIO", "write:ENOSPC"])
async def test_storage_fault_in_commit_keeps_previous(ray_local, tmp_path, monkeypatch, fault):
    coord, samplers, stats = await build(config(tmp_path))
    await coord.save(1)
    monkeypatch.setenv(
        "FORGE_CKPT_FAULT", fault
    )  # the driver writes plain actors, manifest, marker
    with pytest.raises(CheckpointSaveError, match="injected by FORGE_CKPT_FAULT"):
        await coord.save(2)
    monkeypatch.delenv("FORGE_CKPT_FAULT")
    assert coord.steps() == [1] and layout.all_steps(coord.config.folder) == [1]
    assert (await coord.load()).step == 1
    coord.close()


async def test_mismatch_lists_every_difference(ray_local, tmp_path):
    cfg = config(tmp_path, fingerprint="run-a")
    coord, samplers, stats = await build(cfg)
    await coord.save(1)
    coord.close()
    cfg.fingerprint = "run-b"
    coord2 = CheckpointCoordinator(cfg)
    coord2.register("buffer", [Sampler.remote(1)])
    coord2.register("extra", Stats.remote())
    with pytest.raises(CheckpointMismatchError) as e:
        await coord2.load()
    diffs = e.value.differences
    text = "\n".join(diffs)  # each line goes on with its remedy (tests/test_reshard.py)
    assert "buffer: replicas changed: checkpoint=2, current=1. No resharding rule" in text
    assert "extra: registered but not in the checkpoint (step 1)" in text
    assert "sampler: in the checkpoint (step 1) but not registered" in text
    assert "stats: in the checkpoint (step 1) but not registered" in text
    assert any(
        d.startswith("run fingerprint changed: checkpoint=run-a, current=run-b") for d in diffs
    )
    coord2.close()


async def test_exclude_skips_component(ray_local, tmp_path):
    cfg = config(tmp_path)
    coord, samplers, stats = await build(cfg)
    await run_steps(samplers, stats, 2)
    await coord.save(2)
    coord.close()
    coord2, fresh, fresh_stats = await build(cfg)
    await coord2.load(exclude=["stats"])
    assert (await fresh_stats.get.remote())["count"] == 0
    assert len((await fresh[0].get.remote())["history"]) == 2
    coord2.close()


async def test_corrupt_file_detected_and_nothing_applied(ray_local, tmp_path, caplog):
    cfg = config(tmp_path, keep_last=5)
    coord, samplers, stats = await build(cfg)
    await run_steps(samplers, stats, 1)
    await coord.save(1)
    await run_steps(samplers, stats, 1)
    await coord.save(2)
    coord.close()
    comp = layout.read_committed(cfg.folder, 2).components["buffer"]
    victim = os.path.join(
        layout.step_dir(cfg.folder, 2), layout.replica_files(comp, "buffer")[1].path
    )
    with open(victim, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x10]))
    coord2, fresh, fresh_stats = await build(cfg, seeds=(4, 5, 6))
    with pytest.raises(CheckpointCorruptError, match=r"buffer\.1\.\S*msgpack: checksum mismatch"):
        await coord2.load()
    assert (await fresh[0].get.remote())["history"] == []  # nothing half-loaded
    assert (await fresh_stats.get.remote())["count"] == 0
    coord2.config.fallback = True
    with caplog.at_level(logging.WARNING, logger="forge_ckpt"):
        assert (await coord2.load()).step == 1
    assert "step 2 is corrupt" in caplog.text and "falling back to step 1" in caplog.text
    assert len((await fresh[0].get.remote())["history"]) == 1
    coord2.close()


async def test_async_save_snapshot_is_the_cut(ray_local, tmp_path):
    cfg = config(tmp_path, async_mode="deferred")
    coord, samplers, stats = await build(cfg)
    await run_steps(samplers, stats, 2)
    at_save = await samplers[0].get.remote()
    res = await coord.save(2)
    assert not res.committed and res.blocked_s > 0
    await run_steps(samplers, stats, 3)  # training goes on while the write runs
    done = await coord.wait()
    assert done.committed and done.total_s >= done.blocked_s and coord.steps() == [2]
    coord.close()
    coord2, fresh, _ = await build(cfg, seeds=(4, 5, 6))
    await coord2.load()
    assert_state_equal(await fresh[0].get.remote(), at_save)
    coord2.close()


async def test_async_background_failure_is_raised_by_wait(ray_local, tmp_path, monkeypatch):
    cfg = config(tmp_path, async_mode="deferred")
    coord, samplers, stats = await build(cfg)
    await coord.save(1)
    await coord.wait()
    monkeypatch.setenv("FORGE_CKPT_FAULT", "rename:EIO")  # the commit in the background fails
    await coord.save(2)
    with pytest.raises(CheckpointSaveError, match="commit: OSError: .*injected"):
        await coord.wait()
    monkeypatch.delenv("FORGE_CKPT_FAULT")
    assert coord.steps() == [1]
    await coord.save(3)
    assert (await coord.wait()).committed and coord.steps() == [1, 3]
    coord.close()


async def test_retention_and_keep_every(ray_local, tmp_path):
    coord, _, _ = await build(config(tmp_path, keep_last=2, keep_every=4))
    for step in range(1, 9):
        await coord.save(step)
    assert coord.steps() == [4, 7, 8]
    assert layout.all_steps(coord.config.folder) == [4, 7, 8]
    coord.close()


async def test_second_coordinator_is_refused(ray_local, tmp_path):
    coord = CheckpointCoordinator(config(tmp_path))
    with pytest.raises(CheckpointLockedError, match=f"pid {os.getpid()}"):
        CheckpointCoordinator(config(tmp_path))
    coord.close()
    CheckpointCoordinator(config(tmp_path)).close()


async def test_bad_names_and_actors_are_refused(ray_local, tmp_path):
    coord = CheckpointCoordinator(config(tmp_path))
    for bad in ("../x", "a/b", "", "trainer"):
        with pytest.raises(InvalidNameError):
            coord.register(bad, Stats.remote())

    @ray.remote
    class NoState:
        def f(self):
            return 1

    with pytest.raises(TypeError, match="has no state_dict"):
        coord.register("nostate", NoState.remote())
    coord.close()


async def test_load_explicit_step(ray_local, tmp_path):
    cfg = config(tmp_path, keep_last=None)
    coord, samplers, stats = await build(cfg)
    for step in (1, 2, 3):
        await run_steps(samplers, stats, 1)
        await coord.save(step)
    assert (await coord.load(step=2)).step == 2
    assert len((await samplers[0].get.remote())["history"]) == 2
    with pytest.raises(Exception, match="step 9 is not a committed step"):
        await coord.load(step=9)
    coord.close()
