"""One test per hole a review found (issue 14): each failed on the code before the fix.

A failed async save wedging the trainer, a rollback resuming the abandoned branch, a corrupt
step that could never be replaced, relative folders resolved per actor, the lease leaking on a
full disk, close() racing a commit, private APIs, and errors that dropped the remote traceback.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import ray

from forge_ckpt import (
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointError,
    CheckpointSaveError,
    spawn_trainer_ranks,
)
from forge_ckpt.steps import layout

sys.path.insert(0, os.path.dirname(__file__))
import _trainer_model  # noqa: E402
from _paths import actor_path  # noqa: E402
from test_coordinator import Sampler, Stats, build, config, run_steps  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def rank_cls(ray_local):
    ray_local.cloudpickle.register_pickle_by_value(_trainer_model)
    return ray_local.remote(num_cpus=0)(_trainer_model.TrainerRank)


async def test_failed_async_save_does_not_wedge_the_trainer(rank_cls, tmp_path):
    ranks = spawn_trainer_ranks(rank_cls, 1)
    ray.get([r.setup.remote(0) for r in ranks])
    sampler = Sampler.remote(1)
    coord = CheckpointCoordinator(config(tmp_path, async_mode="deferred"))
    coord.set_trainer(ranks)
    coord.register("sampler", sampler)
    await coord.save(1)
    await coord.wait()
    coord.config.save_timeout_s = 3  # the hang below lasts until the save has failed
    hold = str(tmp_path / "hold")
    open(hold, "w").close()  # noqa: SIM115
    for mode in ("raise", f"hang:{hold}"):  # the actor fails while the trainer writes
        await sampler.set_fail.remote(mode)
        with pytest.raises(CheckpointSaveError, match="actor 'sampler' replica 0"):
            await coord.save(2)
            await coord.wait()
    os.remove(hold)  # the hang ends
    await sampler.get.remote()  # queued behind the hanging call: answers once it has ended
    coord.config.save_timeout_s = 120  # a busy machine must not turn the death into a timeout
    ray.kill(sampler)  # and an actor that dies while the trainer writes in the background
    with pytest.raises(CheckpointSaveError, match="actor 'sampler' replica 0: the actor died"):
        await coord.save(2)
        await coord.wait()
    sampler = Sampler.remote(1)
    coord.register("sampler", sampler, replace=True)
    await ranks[0].train.remote(1)
    want = await ranks[0].summary.remote()
    assert (await coord.save(2)).step == 2  # the trainer rank was aborted cleanly: not wedged
    await coord.wait()
    await ranks[0].train.remote(1)
    assert (await coord.load()).step == 2
    got = await ranks[0].summary.remote()
    assert all((got["full_params"][k] == want["full_params"][k]).all() for k in want["full_params"])
    ray.kill(sampler)
    coord.close()
    for r in ranks:
        ray.kill(r)


async def test_rollback_retires_the_abandoned_branch(ray_local, tmp_path):
    coord, samplers, stats = await build(config(tmp_path, keep_last=10))
    for step in range(1, 6):
        await run_steps(samplers, stats, 1)
        await coord.save(step, extra={"branch": "old"})
    assert (await coord.load(step=3)).step == 3
    await run_steps(samplers, stats, 1)
    result = await coord.save(4, extra={"branch": "new"})  # not "already committed"
    assert result.committed and coord.steps() == [1, 2, 3, 4]
    coord.close()
    coord, samplers, stats = await build(config(tmp_path, keep_last=10), seeds=(7, 8, 9))
    loaded = await coord.load()
    assert loaded.step == 4 and loaded.extra == {"branch": "new"}  # never the old step 5
    with pytest.raises(CheckpointSaveError, match="step 4 is newer"):
        await coord.save(0)  # a step older than the newest needs an explicit load(step=...)
    coord.close()


async def test_corrupt_step_passed_over_is_replaced(ray_local, tmp_path):
    cfg = config(tmp_path, fallback=True)
    coord, samplers, stats = await build(cfg)
    for step in (1, 2):
        await run_steps(samplers, stats, 1)
        await coord.save(step)
    coord.close()
    victim = os.path.join(layout.step_dir(cfg.folder, 2), actor_path(cfg.folder, 2, "sampler"))
    with open(victim, "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    coord, samplers, stats = await build(cfg)
    assert (await coord.load()).step == 1
    await run_steps(samplers, stats, 1)
    assert (await coord.save(2)).committed  # the damaged step 2 was moved aside
    coord.close()
    coord, samplers, stats = await build(cfg)
    assert (await coord.load()).step == 2  # a resume now finds the new, intact step 2
    assert layout.quarantined(cfg.folder)
    coord.close()


async def test_relative_folder_is_made_absolute_in_the_driver(ray_local, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # after ray.init: actors keep their own working directory
    cfg = CheckpointConfig(folder="rel_ckpt")
    assert cfg.folder == str(tmp_path / "rel_ckpt")
    coord, samplers, stats = await build(cfg)
    await run_steps(samplers, stats, 1)
    assert (await coord.save(1)).committed
    assert (await coord.load()).step == 1
    coord.close()


def test_lease_is_not_leaked_when_writing_it_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_CKPT_FAULT", "write:ENOSPC")
    with pytest.raises(CheckpointError, match="No space left"):
        CheckpointCoordinator(config(tmp_path))
    monkeypatch.delenv("FORGE_CKPT_FAULT")
    CheckpointCoordinator(config(tmp_path)).close()  # nothing of the failed start holds it


def test_no_private_torch_or_torchtitan_names_and_apps_use_the_public_api():
    private = re.compile(r"(from torch[\w.]* import _\w|torchtitan[\w.]*\._|\.manager\._)")
    for root, _, files in os.walk(os.path.join(ROOT, "forge_ckpt")):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(root, name)).read()
                assert not private.search(text), f"{name}: {private.search(text).group(0)}"
    import forge_ckpt

    for root, _, files in os.walk(os.path.join(ROOT, "apps", "grpo")):
        for name in (f for f in files if f.endswith(".py")):
            text = re.sub(r"#.*", "", open(os.path.join(root, name)).read())
            for mod in re.findall(r"from (forge_ckpt[\w.]*) import", text):
                assert mod == "forge_ckpt", f"apps/grpo/{name} imports {mod}"
            for group in re.findall(r"from forge_ckpt import (\([^)]*\)|[\w, ]+)", text):
                names = group.strip("()")
                for n in filter(None, (x.strip() for x in names.split(","))):
                    assert n in forge_ckpt.__all__, f"apps/grpo/{name}: {n} is not public"


@ray.remote
class Failing(Stats.__ray_actor_class__):  # type: ignore[name-defined]
    async def state_dict(self):
        def deep_inside_the_actor():
            raise RuntimeError("first line\nthe buffer index 7 is out of range")

        deep_inside_the_actor()


async def test_errors_keep_the_remote_traceback(ray_local, tmp_path, caplog):
    coord = CheckpointCoordinator(config(tmp_path))
    coord.register("buffer", Failing.remote())
    with pytest.raises(CheckpointSaveError) as e:
        await coord.save(1)
    msg = str(e.value)
    assert "actor 'buffer' replica 0: RuntimeError: the buffer index 7 is out of range" in msg
    assert e.value.__cause__ is not None
    assert "deep_inside_the_actor" in e.value.details["actor 'buffer' replica 0"]
    assert "deep_inside_the_actor" in caplog.text  # and in the log
    coord.close()
