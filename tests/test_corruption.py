"""Every kind of file x every kind of damage: `forge-ckpt verify` and `load()` name the file,
nothing is applied, and `fallback=True` loads the newest intact step and says so."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys

import pytest
from typer.testing import CliRunner

from forge_ckpt import CheckpointConfig, CheckpointCoordinator, CheckpointCorruptError
from forge_ckpt.cli import app
from forge_ckpt.steps import layout

sys.path.insert(0, os.path.dirname(__file__))
from _paths import actor_path  # noqa: E402
from crash_actors import Sampler, make_trainer_ranks  # noqa: E402

FILES = [".metadata", "__0_0.distcp", "actors/sampler.0.msgpack", "manifest.json", "COMMIT"]
DAMAGE = ["flip", "truncate", "delete"]


def damage(path: str, how: str) -> None:
    if how == "delete":
        os.unlink(path)
        return
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if how == "truncate":
            f.truncate(size // 2)
        else:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0x04]))


@pytest.fixture(scope="module")
def pristine(ray_local, tmp_path_factory):
    """A folder with committed steps 1 and 2 from a trainer and an actor, plus fresh actors."""
    folder = str(tmp_path_factory.mktemp("pristine") / "ckpt")

    async def make():
        coord = CheckpointCoordinator(CheckpointConfig(folder=folder))
        sampler, trainer = Sampler.remote(1), make_trainer_ranks(1)
        coord.register("sampler", sampler)
        coord.set_trainer(trainer)
        for step in (1, 2):
            await sampler.step.remote()
            await asyncio.gather(*(t.train_step.remote() for t in trainer))
            await coord.save(step)
        coord.close()

    asyncio.run(make())
    fresh = {"sampler": Sampler.remote(9), "trainer": make_trainer_ranks(1, seed=3)}
    return folder, fresh


async def open_and_load(folder, fresh, **kw):
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder, **kw))
    coord.register("sampler", fresh["sampler"])
    coord.set_trainer(fresh["trainer"])
    try:
        return await coord.load()
    finally:
        coord.close()


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("name", FILES)
def test_damage_is_detected_and_named(pristine, tmp_path, name, how, caplog):
    src, fresh = pristine
    folder = str(tmp_path / "ckpt")
    shutil.copytree(src, folder)
    step2 = layout.step_dir(folder, 2)
    if name.startswith("actors/"):  # (named for the save attempt that wrote it)
        name = actor_path(folder, 2, "sampler")
    damage(os.path.join(step2, name), how)
    before = asyncio.run(_snapshot(fresh))

    result = CliRunner().invoke(app, ["verify", step2])
    assert result.exit_code == 1
    assert os.path.basename(name) in result.output

    if (name, how) == ("COMMIT", "delete"):
        # Indistinguishable from a crash between manifest and marker: the step was never
        # committed, so start-up removes it, says so, and the previous step loads.
        with caplog.at_level(logging.WARNING, logger="forge_ckpt"):
            assert asyncio.run(open_and_load(folder, fresh)).step == 1
        assert "removed uncommitted leftover step-2" in caplog.text
        assert not os.path.exists(step2)
        return
    with pytest.raises(CheckpointCorruptError) as e:
        asyncio.run(open_and_load(folder, fresh))
    assert os.path.basename(name) in str(e.value)
    assert asyncio.run(_snapshot(fresh)) == before  # nothing was applied
    assert os.path.isdir(step2)  # a damaged committed step is kept for inspection

    with caplog.at_level(logging.WARNING, logger="forge_ckpt"):
        loaded = asyncio.run(open_and_load(folder, fresh, fallback=True))
    assert loaded.step == 1
    assert "step 2 is corrupt" in caplog.text and "falling back to step 1" in caplog.text
    assert len(asyncio.run(_snapshot(fresh))["history"]) == 1
    # The damaged step was moved aside: step 2 can be committed again by the resumed run.
    assert not os.path.exists(step2) and layout.quarantined(folder)[0].startswith("step-2.")


async def _snapshot(fresh):
    return {
        "history": await fresh["sampler"].get_history.remote(),
        "weights": await fresh["trainer"][0].fingerprint.remote(),
    }


def test_verify_passes_on_intact_step(pristine):
    folder, _ = pristine
    result = CliRunner().invoke(app, ["verify", layout.step_dir(folder, 2)])
    assert result.exit_code == 0, result.output
    assert "files intact" in result.output and "FAIL" not in result.output
