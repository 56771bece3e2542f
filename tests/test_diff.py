"""`forge-ckpt diff` and `diff_steps`: steps of a real trainer rank and actor, saved with and
without digests. Unchanged state is proven by digest where the manifests have one and by value
otherwise; a training step shows as changed weights with the right largest difference; an
actor that moved shows which of its values changed; steps in two storages (local and the test
SeaweedFS) compare like steps of one folder.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest
import ray
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from forge_ckpt import CheckpointConfig, CheckpointCoordinator
from forge_ckpt.cli import app
from forge_ckpt.steps import layout
from forge_ckpt.storage import open_storage
from forge_ckpt.tools.diff import diff_steps

sys.path.insert(0, os.path.dirname(__file__))
from crash_actors import Sampler, make_trainer_ranks  # noqa: E402


@pytest.fixture(scope="module")
def folders(ray_local, tmp_path_factory):
    """digest -> folder with steps 1, 2 (nothing moved in between) and 3 (one training step,
    one sampler step); the same actors save into both folders."""
    sampler, ranks = Sampler.remote(1), make_trainer_ranks(1)
    coords = {}
    for digest in ("blake3", None):
        path = str(tmp_path_factory.mktemp("diff") / "ckpt")
        coords[digest] = CheckpointCoordinator(CheckpointConfig(folder=path, digest=digest))
        coords[digest].register("sampler", sampler)
        coords[digest].set_trainer(ranks)

    async def save(step: int) -> None:
        for coord in coords.values():
            await coord.save(step, extra={"step": step})

    asyncio.run(save(1))
    asyncio.run(save(2))
    ray.get([sampler.step.remote(), *[r.train_step.remote() for r in ranks]])
    asyncio.run(save(3))
    for coord in coords.values():
        coord.close()
    return {d: c.config.folder for d, c in coords.items()}


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def weights(step_dir: str) -> dict[str, torch.Tensor]:
    """The saved model weights, read by stock DCP (the reference for the differences)."""
    sd = {"0.weight": torch.empty(32, 16), "2.weight": torch.empty(4, 32)}
    dcp.load(sd, checkpoint_id=step_dir, no_dist=True)
    return sd


@pytest.mark.parametrize("digest", ["blake3", None])
def test_unchanged_steps_by_digest_or_value(folders, digest):
    folder = folders[digest]
    res = run("diff", layout.step_dir(folder, 1), layout.step_dir(folder, 2), "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["schema_version"] == 1 and report["command"] == "diff" and report["same"]
    assert [c["name"] for c in report["components"]] == ["sampler", "trainer"]
    entries = [e for c in report["components"] for e in c["entries"]]
    assert {e["by"] for e in entries} == {"digest" if digest else "value"}
    keys = {e["key"] for e in entries}
    assert "0.weight" in keys and "optimizer.state.0.weight.exp_avg" in keys
    weight = next(e for e in entries if e["key"] == "0.weight")
    assert weight["shape_a"] == [32, 16] and weight["dtype_a"] == "float32"


@pytest.mark.parametrize("digest", ["blake3", None])
def test_training_step_shows_as_changed_with_max_difference(folders, digest):
    folder = folders[digest]
    a, b = layout.step_dir(folder, 2), layout.step_dir(folder, 3)
    result = diff_steps(folder, 2, folder, 3)
    assert not result.same
    trainer = next(c for c in result.components if c.name == "trainer")
    by_key = {e.key: e for e in trainer.entries}
    wa, wb = weights(a), weights(b)
    for key in wa:
        assert by_key[key].status == "changed" and by_key[key].by == "value"
        assert by_key[key].max_abs_diff == float((wa[key].double() - wb[key].double()).abs().max())
    sampler = {e.key: e for e in next(c for c in result.components if c.name == "sampler").entries}
    assert sampler["state.history"].status == "changed"  # one more draw
    assert sampler["state.blob"].status == "unchanged" and sampler["state.blob"].kind == "array"
    assert sampler["rng.generators.rng.state.state.state"].status == "changed"
    res = run("diff", a, b)
    assert res.exit_code == 3, res.output
    assert "0.weight" in res.output and "changed" in res.output and "the steps differ" in res.output
    assert "blob" not in res.output and "blob" in run("diff", a, b, "--all").output


def test_bad_input_exit_codes(folders, tmp_path):
    folder = folders["blake3"]
    res = run("diff", layout.step_dir(folder, 1), str(tmp_path / "nope"), "--json")
    assert res.exit_code == 2 and "not a step folder" in json.loads(res.stdout)["error"]
    res = run("diff", layout.step_dir(folder, 1), layout.step_dir(folder, 9))
    assert res.exit_code == 1 and "step-9" in res.output


def test_local_against_seaweedfs(folders, s3_folder, monkeypatch):
    folder = folders[None]
    s3, local = open_storage(s3_folder.url, s3_folder.options), open_storage(folder)
    for path, _ in local.walk(layout.step_name(3)):  # the same committed step, on S3
        s3.write(path, local.read(path))
    for k, v in s3_folder.server.env().items():  # the CLI takes the standard AWS environment
        monkeypatch.setenv(k, v)
    res = run("diff", layout.step_dir(folder, 3), f"{s3_folder.url}/step-3", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["same"], res.output
    res = run("diff", f"{s3_folder.url}/step-3", layout.step_dir(folder, 2), "--json")
    assert res.exit_code == 3 and not json.loads(res.stdout)["same"]
