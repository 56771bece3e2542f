"""`forge-ckpt export`: a 2-rank FSDP2 trainer step (local and s3://) becomes HF sharded
safetensors whose tensors equal the trainer's full weights bit for bit, without optimizer
state; damaged or uncommitted steps fail with the file named and nothing left in OUT; the
GRPO policy loads from an export."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys

import pytest
import ray
import torch
from safetensors.torch import load, load_file
from typer.testing import CliRunner

from forge_ckpt import CheckpointConfig, CheckpointCoordinator, spawn_trainer_ranks
from forge_ckpt.cli import app
from forge_ckpt.dcp.metadata import load_metadata
from forge_ckpt.steps import layout
from forge_ckpt.storage import open_storage
from forge_ckpt.tools.export import INDEX

sys.path.insert(0, os.path.dirname(__file__))
import _trainer_model  # noqa: E402
from crash_actors import Sampler  # noqa: E402

STEP = 2


@pytest.fixture(scope="module")
def saved(ray_local, tmp_path_factory):
    """One committed step of a 2-rank FSDP2 trainer, its full weights, and an uncommitted
    copy of it (step 3: no marker)."""
    ray_local.cloudpickle.register_pickle_by_value(_trainer_model)
    ranks = spawn_trainer_ranks(ray_local.remote(num_cpus=0)(_trainer_model.TrainerRank), 2)
    ray.get([r.setup.remote(0) for r in ranks])
    ray.get([r.train.remote(2) for r in ranks])
    folder = str(tmp_path_factory.mktemp("export") / "ckpt")
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder, fingerprint="run-1"))
    coord.set_trainer(ranks)
    asyncio.run(coord.save(STEP))
    coord.close()
    full = ray.get([r.summary.remote() for r in ranks])[0]["full_params"]  # a collective
    for r in ranks:
        ray.kill(r)
    shutil.copytree(layout.step_dir(folder, STEP), layout.step_dir(folder, 3))
    os.remove(os.path.join(layout.step_dir(folder, 3), layout.MARKER))
    return folder, full


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def read_export(out: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The index and every tensor, shard by shard as the index names them."""
    with open(os.path.join(out, INDEX)) as f:
        index = json.load(f)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        part = load_file(os.path.join(out, shard))
        assert all(index["weight_map"][k] == shard for k in part)
        tensors.update(part)
    return index, tensors


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)  # the model's FQNs: no optimizer or other state
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].view(-1), t.view(-1)), name


def test_export_equals_full_weights_in_several_shards(saved, tmp_path):
    folder, full = saved
    out = str(tmp_path / "out")
    res = run("export", layout.step_dir(folder, STEP), "--format", "safetensors", out,
              "--max-shard-size", "2KB")  # fmt: skip
    assert res.exit_code == 0, res.output
    index, tensors = read_export(out)
    assert_bitwise(tensors, full)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(os.listdir(out)) == [*shards, INDEX]
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in full.values())
    assert index["metadata"]["forge_ckpt"] == {"step": STEP, "fingerprint": "run-1"}
    for shard in shards:  # 2 KB each, unless one tensor alone is larger
        size = sum(t.nbytes for t in load_file(os.path.join(out, shard)).values())
        assert size <= 2000 or len(load_file(os.path.join(out, shard))) == 1


def test_folder_option_latest_dtype_and_overwrite(saved, tmp_path):
    folder, full = saved
    out = str(tmp_path / "out")
    assert run("export", "--folder", folder, str(STEP), out).exit_code == 0
    _, tensors = read_export(out)
    assert_bitwise(tensors, full)
    assert sorted(os.listdir(out)) == ["model-00001-of-00001.safetensors", INDEX]
    res = run("export", "--folder", folder, "latest", out)
    assert res.exit_code == 1 and "not empty" in res.output and "--overwrite" in res.output
    res = run("export", "--folder", folder, "latest", out, "--overwrite", "--dtype", "bfloat16",
              "--max-shard-size", "1KiB")  # fmt: skip
    assert res.exit_code == 0, res.output
    _, tensors = read_export(out)
    assert_bitwise(tensors, {k: v.to(torch.bfloat16) for k, v in full.items()})
    assert "model-00001-of-00001.safetensors" not in os.listdir(out)  # old shards replaced
    assert run("export", "--folder", folder, "x", out).exit_code == 2
    assert (
        run("export", layout.step_dir(folder, STEP), out, "--max-shard-size", "2XB").exit_code == 2
    )


def test_corrupt_shard_is_named_and_nothing_is_written(saved, tmp_path):
    folder, full = saved
    copy = str(tmp_path / "ckpt")
    shutil.copytree(layout.step_dir(folder, STEP), layout.step_dir(copy, STEP))
    step_dir = layout.step_dir(copy, STEP)
    with open(os.path.join(step_dir, ".metadata"), "rb") as f:
        meta = load_metadata(f.read(), ".metadata")
    victim = next(i.relative_path for k, i in meta.storage_data.items() if k.fqn == "0.weight")
    with open(os.path.join(step_dir, victim), "r+b") as f:  # flip one byte of a weight chunk
        f.seek(os.path.getsize(f.name) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = str(tmp_path / "out")
    res = run("export", step_dir, out)
    assert res.exit_code == 1 and f"{victim}: checksum mismatch" in res.output, res.output
    assert not os.path.exists(out) or os.listdir(out) == []
    earlier = str(tmp_path / "earlier")  # an earlier export survives a failed --overwrite
    assert run("export", layout.step_dir(folder, STEP), earlier).exit_code == 0
    assert run("export", step_dir, earlier, "--overwrite").exit_code == 1
    assert_bitwise(read_export(earlier)[1], full)


def test_uncommitted_step_and_step_without_trainer(saved, tmp_path):
    folder, _ = saved
    out = str(tmp_path / "out")
    res = run("export", layout.step_dir(folder, 3), out)
    assert res.exit_code == 1 and "never committed" in res.output, res.output
    actors_only = str(tmp_path / "actors_only")
    coord = CheckpointCoordinator(CheckpointConfig(folder=actors_only))
    coord.register("sampler", Sampler.remote(1))
    asyncio.run(coord.save(1))
    coord.close()
    res = run("export", "--folder", actors_only, "1", out)
    assert res.exit_code == 1 and "no trainer component" in res.output, res.output
    assert not os.path.exists(out)


def test_export_from_and_to_s3(saved, s3_folder, monkeypatch, tmp_path):
    folder, full = saved
    s3 = open_storage(s3_folder.url, s3_folder.options)
    local = open_storage(folder)
    for path, _ in local.walk(layout.step_name(STEP)):  # the same committed step, on S3
        s3.write(path, local.read(path))
    for k, v in s3_folder.server.env().items():  # the CLI takes the standard AWS environment
        monkeypatch.setenv(k, v)
    out = str(tmp_path / "out")
    res = run("export", f"{s3_folder.url}/step-{STEP}", out, "--max-shard-size", "3KB")
    assert res.exit_code == 0, res.output
    assert_bitwise(read_export(out)[1], full)
    s3_out = f"s3://{s3_folder.bucket}/export"
    res = run("export", "--folder", s3_folder.url, "latest", s3_out)
    assert res.exit_code == 0, res.output
    dst = open_storage(s3_out, s3_folder.options)
    weight_map = json.loads(dst.read(INDEX))["weight_map"]
    got: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        got.update(load(bytes(dst.read(shard))))
    assert_bitwise(got, full)
    assert s3_folder.options["aws_secret_access_key"] not in res.output


def test_grpo_policy_loads_from_export(ray_local, tmp_path):
    from apps.grpo.config import load_config
    from apps.grpo.model import load_exported
    from apps.grpo.trainer import Trainer

    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "grpo_test.yaml"))
    trainer_cfg = {**cfg["trainer"], "temperature": cfg["policy"]["temperature"]}
    ranks = spawn_trainer_ranks(ray.remote(Trainer).options(num_cpus=0), 1, 0, cfg["task"],
                                cfg["model"], trainer_cfg)  # fmt: skip
    ray.get([r.setup.remote() for r in ranks])
    folder = str(tmp_path / "ckpt")
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder))
    coord.set_trainer(ranks)
    asyncio.run(coord.save(1))
    coord.close()
    weights = ray.get(ranks[0].get_weights.remote())
    ray.kill(ranks[0])
    out = str(tmp_path / "out")
    assert run("export", "--folder", folder, "latest", out).exit_code == 0
    model = load_exported(out, cfg["model"])
    assert_bitwise(model.state_dict(), weights)
