"""Hugging Face export through TorchTitan's adapters: a 2-rank FSDP2 trainer holding TorchTitan's
llama3 and qwen3 debug models saves through forge_ckpt; `forge-ckpt export --hf` writes exactly
`adapter.to_hf(full state dict)` (keys, shapes, dtypes, values), and `from_hf` of the export
loads back into the TorchTitan model bitwise. The wrong flavor, an unknown family and a folder
that is no HF assets folder are refused with OUT left empty.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
from itertools import pairwise

import pytest
import ray
import torch
from typer.testing import CliRunner

from forge_ckpt import CheckpointConfig, CheckpointCoordinator, spawn_trainer_ranks
from forge_ckpt.cli import app
from forge_ckpt.steps import layout
from forge_ckpt.tools.export import INDEX, export_safetensors

sys.path.insert(0, os.path.dirname(__file__))
from test_export import read_export  # noqa: E402

try:  # TorchTitan's model code imports triton (its GPU kernels), also on CPU
    import torchtitan.models.llama3  # noqa: F401
except ImportError as e:
    pytest.skip(
        f"torchtitan.models needs {e.name}: pip install -e '.[test]'", allow_module_level=True
    )

import _titan_model  # noqa: E402

MODELS = {"llama3": ("debugmodel", 1), "qwen3": ("debugmodel", 2)}  # family: (flavor, seed)
STEP = 4


@pytest.fixture(scope="module")
def saved(ray_local, tmp_path_factory):
    """family -> (checkpoint folder, full state dict): one 2-rank save of each model by the same
    rank actors. The qwen3 step records its model in `extra` (as a job may)."""
    ray_local.cloudpickle.register_pickle_by_value(_titan_model)
    ranks = spawn_trainer_ranks(ray_local.remote(num_cpus=0)(_titan_model.TitanRank), 2)
    out = {}
    try:
        for family, (flavor, seed) in MODELS.items():
            ray.get([r.setup.remote(family, flavor, seed) for r in ranks])
            folder = str(tmp_path_factory.mktemp(family) / "ckpt")
            coord = CheckpointCoordinator(CheckpointConfig(folder=folder))
            coord.set_trainer(ranks)
            extra = {"hf_model": f"{family}:{flavor}"} if family == "qwen3" else None
            asyncio.run(coord.save(STEP, extra))
            coord.close()
            full, shapes = ray.get([r.full_state.remote() for r in ranks])[0]  # a collective
            assert any(shapes[k] != tuple(full[k].shape) for k in shapes)  # really sharded
            out[family] = (folder, full)
    finally:
        for r in ranks:
            ray.kill(r)
    return out


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def adapter_of(family: str):
    spec = importlib.import_module(f"torchtitan.models.{family}").model_registry(MODELS[family][0])
    return spec.state_dict_adapter(spec.model, None)


@pytest.mark.parametrize("family", list(MODELS))
def test_export_is_to_hf_and_loads_back_bitwise(saved, tmp_path, family):
    folder, full = saved[family]
    out = str(tmp_path / "hf")
    res = run("export", layout.step_dir(folder, STEP), out, "--hf", f"{family}:debugmodel",
              "--max-shard-size", "4MB")  # fmt: skip
    assert res.exit_code == 0, res.output
    index, got = read_export(out)
    want = adapter_of(family).to_hf(dict(full))
    assert sorted(got) == sorted(want) and len(set(index["weight_map"].values())) > 1
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k], t), k
    assert index["metadata"]["forge_ckpt"]["hf_model"] == f"{family}:debugmodel"
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in want.values())

    back = adapter_of(family).from_hf(dict(got))  # it adds a tied head to what it is given
    model = _titan_model.build(family, "debugmodel", seed=99)  # other weights: overwritten
    model.load_state_dict(back, strict=True)
    for k, t in model.state_dict().items():
        assert torch.equal(t, full[k]), k
    if family == "llama3":  # q/k permuted for HF's rotary layout; the rest as saved
        q = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(got[q], full["layers.0.attention.qkv_linear.wq.weight"])
    else:  # tied head: HF stores the embedding alone
        assert "lm_head.weight" not in got


def test_recorded_model_assets_json_and_bf16(saved, tmp_path):
    folder, full = saved["qwen3"]
    assets = tmp_path / "assets"
    assets.mkdir()
    for name, text in {"config.json": '{"model_type": "qwen3"}', "tokenizer.json": "{}",
                       "model.safetensors.index.json": "{}", "notes.txt": "x"}.items():  # fmt: skip
        (assets / name).write_text(text)
    out = str(tmp_path / "hf")
    res = run("export", "--folder", folder, "latest", out, "--hf-config", str(assets),
              "--dtype", "bfloat16", "--json")  # fmt: skip
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)  # progress lines go to stderr
    assert report["schema_version"] == 1 and report["hf_model"] == "qwen3:debugmodel"
    assert report["assets"] == ["config.json", "tokenizer.json"]
    assert (tmp_path / "hf" / "config.json").read_text() == '{"model_type": "qwen3"}'
    assert not (tmp_path / "hf" / "notes.txt").exists()
    index, got = read_export(out)  # the assets' own index was not copied over ours
    want = adapter_of("qwen3").to_hf(dict(full))
    assert all(torch.equal(got[k], t.to(torch.bfloat16)) for k, t in want.items())
    assert report["files"] == [*sorted(set(index["weight_map"].values())), INDEX]
    titan = str(tmp_path / "titan")  # the recorded model can be declined
    assert run("export", "--folder", folder, "latest", titan, "--hf", "torchtitan").exit_code == 0
    assert sorted(read_export(titan)[1]) == sorted(full)


def test_wrong_model_is_refused_before_writing(saved, tmp_path):
    folder, _ = saved["llama3"]
    out = tmp_path / "hf"
    for hf, words in [("llama3:1B", "not llama3:1B"), ("qwen3:debugmodel", "not qwen3"),
                      ("llama3", "llama3:FLAVOR"), ("nosuch:x", "not a TorchTitan model family")]:  # fmt: skip
        res = run("export", layout.step_dir(folder, STEP), str(out), "--hf", hf)
        assert res.exit_code == 1 and words in res.output, (hf, res.output)
        assert not out.exists() or not os.listdir(out)
    res = run("export", layout.step_dir(folder, STEP), str(out), "--hf", "llama3:debugmodel",
              "--hf-config", str(tmp_path))  # fmt: skip
    assert res.exit_code == 1 and "no config.json" in res.output
    assert not out.exists() or not os.listdir(out)


def test_library_api_reports_progress(saved, tmp_path):
    folder, full = saved["llama3"]
    seen: list[tuple[int, int]] = []
    done = export_safetensors(folder, STEP, str(tmp_path / "hf"), hf="llama3:debugmodel",
                              progress=lambda n, total: seen.append((n, total)))  # fmt: skip
    assert done.hf == "llama3:debugmodel" and done.tensors == len(full)  # lm_head untied
    assert len(seen) == len(full) and seen[-1] == (done.total_size, done.total_size)
    assert all(a[0] < b[0] for a, b in pairwise(seen))
