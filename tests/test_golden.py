"""Every release reads every earlier on-disk format: the golden checkpoints in tests/golden/v<N>/
(written once per format version by scripts/make_golden.py, then frozen) load bit for bit.

Each folder is loaded from a copy (a load takes the folder's lease and may clean up) into a
fresh 2-rank trainer with fresh actors, and resharded into a 1-rank trainer; the CLI verifies
and inspects it. A version-1 manifest (no lease generation) is still read; a newer format
version than this release knows is refused with a hint to upgrade.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import ray
from typer.testing import CliRunner

from forge_ckpt import (
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointCorruptError,
    spawn_trainer_ranks,
)
from forge_ckpt.cli import app
from forge_ckpt.steps import layout
from forge_ckpt.storage import crc32c_of_bytes

sys.path.insert(0, os.path.dirname(__file__))
import _trainer_model  # noqa: E402
import golden_state  # noqa: E402

GOLDEN = Path(__file__).parent / "golden"
VERSIONS = sorted(p.name for p in GOLDEN.glob("v*") if (p / "expected.json").exists())


@pytest.fixture(scope="module")
def classes(ray_local):
    for module in (_trainer_model, golden_state):
        ray_local.cloudpickle.register_pickle_by_value(module)
    rank = ray_local.remote(num_cpus=0)(_trainer_model.TrainerRank)
    return rank, ray_local.remote(num_cpus=0)(golden_state.GoldenActor)


@pytest.fixture(params=VERSIONS)
def golden(request, tmp_path):
    """A copy of one golden folder and what it must give back."""
    copy = tmp_path / request.param
    shutil.copytree(GOLDEN / request.param, copy)
    return str(copy), json.loads((copy / "expected.json").read_text())


def test_every_format_version_this_release_writes_has_a_golden_folder():
    assert f"v{layout.FORMAT_VERSION}" in VERSIONS, "run scripts/make_golden.py"
    assert set(layout.READABLE_VERSIONS) >= {int(v[1:]) for v in VERSIONS}


def fresh_actors(actor_cls, expected: dict) -> dict[str, list]:
    """Actors with other seeds than the golden ones: the load must overwrite all of it."""
    return {
        name: [actor_cls.remote(1000 + seed) for seed in spec["seeds"]]
        for name, spec in expected["actors"].items()
    }


def check_trainer(ranks: list, want: dict, probes: bool) -> None:
    for rank, summary in enumerate(ray.get([r.summary.remote() for r in ranks])):
        got = {k: golden_state.digest(summary[k]) for k in ("full_params", "full_moments")}
        assert got["full_params"] == want["full_params"], f"rank {rank}: parameters"
        assert got["full_moments"] == want["full_moments"], f"rank {rank}: optimizer moments"
        assert golden_state.digest(summary["lr"]) == want["lr"]
        assert golden_state.digest(summary["last_lr"]) == want["last_lr"]
        assert (summary["last_epoch"], summary["train_step"]) == (
            want["last_epoch"],
            want["train_step"],
        )
    if probes:  # RNG streams are restored only at the same world size
        got_probes = ray.get([r.probe.remote() for r in ranks])
        assert golden_state.digest(got_probes) == want["probe"], "trainer RNG streams"


async def test_golden_loads_bitwise(classes, golden):
    rank_cls, actor_cls = classes
    folder, expected = golden
    want = expected["trainer"]
    ranks = spawn_trainer_ranks(rank_cls, want["world"])
    ray.get([r.setup.remote(want["seed"] + 7) for r in ranks])
    actors = fresh_actors(actor_cls, expected)
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder))
    try:
        coord.set_trainer(ranks)
        for name, handles in actors.items():
            coord.register(name, handles)
        assert coord.steps() == [expected["step"]]
        loaded = await coord.load()
        assert loaded is not None and loaded.step == expected["step"]
        assert loaded.extra == expected["extra"]
        assert loaded.manifest.format_version == expected["format_version"]
        check_trainer(ranks, want, probes=True)
        for name, handles in actors.items():
            seeds = expected["actors"][name]["seeds"]
            version = expected["state_version"]
            problems = ray.get(
                [h.mismatch.remote(s, version) for h, s in zip(handles, seeds, strict=True)]
            )
            assert problems == [None] * len(handles), f"{name}: {problems}"
            probes = golden_state.digest(ray.get([h.probe.remote() for h in handles]))
            assert probes == expected["actors"][name]["probe"], f"{name}: RNG streams"
    finally:
        coord.close()
        for h in [*ranks, *(h for hs in actors.values() for h in hs)]:
            ray.kill(h)


async def test_golden_reshards_into_one_rank(classes, golden):
    rank_cls, _ = classes
    folder, expected = golden
    (rank,) = ranks = spawn_trainer_ranks(rank_cls, 1)
    ray.get(rank.setup.remote(expected["trainer"]["seed"] + 7))
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder))
    try:
        coord.set_trainer(ranks)
        loaded = await coord.load(exclude=list(expected["actors"]), allow_mismatch=True)
        assert loaded is not None and loaded.step == expected["step"]
        check_trainer(ranks, expected["trainer"], probes=False)
    finally:
        coord.close()
        ray.kill(rank)


def test_golden_verify_and_inspect(golden):
    folder, expected = golden
    step_folder = f"{folder}/{layout.step_name(expected['step'])}"
    for command in ("verify", "inspect"):
        result = CliRunner().invoke(app, [command, step_folder])
        assert result.exit_code == 0, f"forge-ckpt {command}:\n{result.output}"
    assert "FAIL" not in result.output


def rewrite_manifest(folder: str, step: int, **changes) -> bytes:
    """Rewrite a committed step's manifest as another release would have written it, and its
    marker to match (a v1 marker has no generation)."""
    step_path = Path(folder) / layout.step_name(step)
    manifest = json.loads((step_path / layout.MANIFEST).read_text())
    manifest.pop("generation")
    manifest.update(changes)
    data = json.dumps(manifest, indent=1).encode()
    (step_path / layout.MANIFEST).write_bytes(data)
    marker = {"step": step, "manifest_crc32c": crc32c_of_bytes(data)}
    (step_path / layout.MARKER).write_bytes(json.dumps(marker).encode())
    (Path(folder) / layout.LEASE).unlink(missing_ok=True)  # its lease had no commit record
    return data


async def test_version_1_manifest_is_read(classes, tmp_path):
    _, actor_cls = classes
    folder = str(tmp_path / "ckpt")
    actor = actor_cls.remote(3)
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder))
    coord.register("buffer", actor)
    assert (await coord.save(5, extra={"v": 1})).committed
    coord.close()
    rewrite_manifest(folder, 5, format_version=1)
    manifest = layout.read_committed(folder, 5)
    assert (manifest.format_version, manifest.generation, manifest.step) == (1, 0, 5)
    ray.get(actor.load_state_dict.remote({}))  # forget it: the load must bring it back
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder))
    try:
        coord.register("buffer", actor)
        loaded = await coord.load()
        assert loaded is not None and (loaded.step, loaded.extra) == (5, {"v": 1})
        assert ray.get(actor.mismatch.remote(3)) is None
    finally:
        coord.close()
        ray.kill(actor)
    result = CliRunner().invoke(app, ["verify", f"{folder}/step-5"])
    assert result.exit_code == 0, result.output


def test_newer_format_version_is_refused(tmp_path):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(GOLDEN / f"v{layout.FORMAT_VERSION}", folder)
    step = json.loads((Path(folder) / "expected.json").read_text())["step"]
    rewrite_manifest(folder, step, format_version=99)
    with pytest.raises(CheckpointCorruptError, match="upgrade forge_ckpt") as info:
        layout.read_committed(folder, step)
    assert "format version 99" in str(info.value)
