"""Someone who can write the checkpoint folder (issue 17): loading never runs code, and a signed
step cannot be altered unseen.

The attack: replace a committed step's DCP `.metadata` (or an actor file, or a trainer rank
file) with a pickle whose `__reduce__` runs a command, then rewrite manifest.json and COMMIT so
that every size and CRC32C matches. The payload must never run (a canary file is never
created) in load(), forge-ckpt verify / inspect / list, or the GRPO app's resume; the step is
reported as corrupt. With signing on, any change without the key is refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import ray
from typer.testing import CliRunner

from forge_ckpt import (
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointCorruptError,
    CheckpointSignatureError,
    spawn_trainer_ranks,
)
from forge_ckpt.cli import app
from forge_ckpt.steps import layout
from forge_ckpt.storage import crc32c_of_bytes

sys.path.insert(0, os.path.dirname(__file__))
import _trainer_model  # noqa: E402
from _paths import actor_path  # noqa: E402
from test_coordinator import Sampler  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Payload:
    def __init__(self, canary: str) -> None:
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


def poison(folder: str, step: int, relpath: str, canary: str) -> str:
    """Replace one file with a code-running pickle and make manifest and marker match it
    (`relpath` names an actor file without its save attempt); returns the file's path."""
    step_dir = layout.step_dir(folder, step)
    data = pickle.dumps(Payload(canary))
    with open(os.path.join(step_dir, layout.MANIFEST)) as f:
        manifest = json.load(f)
    for comp in manifest["components"].values():
        for rec in comp["files"]:
            if layout.logical_path(rec["path"]) == relpath:
                relpath = rec["path"]
                rec.update(size=len(data), crc32c=crc32c_of_bytes(data))
                rec.pop("digest", None)
    with open(os.path.join(step_dir, relpath), "wb") as f:
        f.write(data)
    raw = json.dumps(manifest).encode()
    with open(os.path.join(step_dir, layout.MANIFEST), "wb") as f:
        f.write(raw)
    with open(os.path.join(step_dir, layout.MARKER), "wb") as f:
        f.write(layout.marker_bytes(step, crc32c_of_bytes(raw), manifest.get("generation", 0)))
    return relpath


@pytest.fixture(scope="module")
def job(ray_local, tmp_path_factory):
    ray_local.cloudpickle.register_pickle_by_value(_trainer_model)
    ranks = spawn_trainer_ranks(ray_local.remote(num_cpus=0)(_trainer_model.TrainerRank), 1)
    ray.get([r.setup.remote(0) for r in ranks])
    sampler = Sampler.remote(1)
    yield ranks, sampler
    for h in (*ranks, sampler):
        ray.kill(h)


def saved(job, folder: str, **kw) -> CheckpointCoordinator:
    ranks, sampler = job
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder, **kw))
    coord.set_trainer(ranks)
    coord.register("sampler", sampler)
    return coord


@pytest.mark.parametrize(
    "victim", [".metadata", "actors/sampler.0.msgpack", "trainer/rank-0.msgpack"]
)
def test_poisoned_files_never_run_and_are_reported(job, tmp_path, victim):
    folder, canary = str(tmp_path / "ckpt"), str(tmp_path / "CANARY")
    coord = saved(job, folder)
    asyncio.run(coord.save(1))
    coord.close()
    victim = poison(folder, 1, victim, canary)

    coord = saved(job, folder)
    with pytest.raises(CheckpointCorruptError, match=os.path.basename(victim)):
        asyncio.run(coord.load())
    coord.close()
    runner = CliRunner()
    verify = runner.invoke(app, ["verify", layout.step_dir(folder, 1)])
    assert verify.exit_code == 1 and "FAIL" in verify.output, verify.output
    runner.invoke(app, ["inspect", layout.step_dir(folder, 1)])
    runner.invoke(app, ["list", folder])
    assert not os.path.exists(canary), "the payload ran"


def test_grpo_resume_from_a_poisoned_folder_does_not_run_the_payload(tmp_path):
    run_dir, canary = str(tmp_path / "run"), str(tmp_path / "CANARY")
    cmd = [sys.executable, "-m", "apps.grpo.main", "--config", "configs/grpo_test.yaml"]
    args = [f"run_dir={run_dir}", "steps=2", "checkpoint.interval=2"]
    first = subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    poison(os.path.join(run_dir, "checkpoints"), 2, ".metadata", canary)
    resumed = subprocess.run([*cmd, *args, "steps=3"], cwd=ROOT, capture_output=True, text=True,
                             timeout=600)  # fmt: skip
    assert resumed.returncode != 0 and ".metadata" in resumed.stderr, resumed.stderr[-2000:]
    assert "not part of DCP's metadata format" in resumed.stderr
    assert not os.path.exists(canary), "the payload ran"


# ---- signed checkpoints ------------------------------------------------------------------


def test_signed_step_loads_and_any_change_is_refused(job, tmp_path, monkeypatch):
    folder = str(tmp_path / "ckpt")
    coord = saved(job, folder, signing_key="k1")
    asyncio.run(coord.save(1))
    coord.close()
    manifest = layout.read_committed(folder, 1)
    assert all(f.digest and f.digest.startswith("blake3:") for f in manifest.files)
    assert "k1" not in open(os.path.join(layout.step_dir(folder, 1), layout.MARKER)).read()

    coord = saved(job, folder, signing_key="k1")
    assert asyncio.run(coord.load()).step == 1  # a correctly signed step loads
    coord.close()
    coord = saved(job, folder, verify_keys=["k0", "k1"])  # rotation: verify-only keys
    assert asyncio.run(coord.load()).step == 1
    coord.close()

    for rec in manifest.files:  # flipping any byte of any file is refused
        copy = str(tmp_path / f"flip-{rec.path.replace('/', '_')}")
        shutil.copytree(folder, copy)
        path = os.path.join(layout.step_dir(copy, 1), rec.path)
        with open(path, "r+b") as f:
            f.seek(rec.size // 2)
            b = f.read(1)
            f.seek(rec.size // 2)
            f.write(bytes([b[0] ^ 1]))
        coord = saved(job, copy, signing_key="k1")
        with pytest.raises(CheckpointCorruptError, match=os.path.basename(rec.path)):
            asyncio.run(coord.load())
        coord.close()
        monkeypatch.setenv("FORGE_CKPT_VERIFY_KEYS", "k1")
        out = CliRunner().invoke(app, ["verify", layout.step_dir(copy, 1)])
        monkeypatch.delenv("FORGE_CKPT_VERIFY_KEYS")
        assert out.exit_code == 1, out.output


def test_rewritten_manifest_and_wrong_or_missing_keys(job, tmp_path):
    folder = str(tmp_path / "ckpt")
    coord = saved(job, folder, signing_key="k1")
    asyncio.run(coord.save(1))
    coord.close()
    forged = str(tmp_path / "forged")
    shutil.copytree(folder, forged)
    poison(forged, 1, "actors/sampler.0.msgpack", str(tmp_path / "CANARY"))  # marker unsigned
    coord = saved(job, forged, signing_key="k1")
    with pytest.raises(CheckpointSignatureError, match="not signed"):
        asyncio.run(coord.load())
    coord.close()

    coord = saved(job, folder, signing_key="wrong")
    with pytest.raises(CheckpointSignatureError, match="signature does not match"):
        asyncio.run(coord.load())
    coord.close()
    coord = saved(job, folder)  # no key at all: a signed step is not loaded unchecked
    with pytest.raises(CheckpointSignatureError, match="no key is configured"):
        asyncio.run(coord.load())
    coord.close()
    coord = saved(job, folder, signing_key="wrong", fallback=True)
    with pytest.raises(CheckpointSignatureError):
        asyncio.run(coord.load())
    coord.close()
    assert layout.committed_steps(folder) == [1]  # a wrong key never moves a step aside


def flip_byte(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))


@pytest.mark.parametrize("victim", ["actors/sampler.0.msgpack", "__0_0.distcp"])
def test_a_signed_step_is_verified_even_with_verify_on_load_off(job, tmp_path, victim):
    """verify_on_load=False skips CRC32C checks of unsigned steps only: skipping the digests of
    a signed step would load any change made without the key."""
    folder = str(tmp_path / "ckpt")
    coord = saved(job, folder, signing_key="k1")
    asyncio.run(coord.save(1))
    coord.close()
    if victim.startswith("actors/"):  # (named for the save attempt that wrote it)
        victim = actor_path(folder, 1, "sampler")
    path = os.path.join(layout.step_dir(folder, 1), victim)
    flip_byte(path, os.path.getsize(path) - 8)  # tensor bytes: it would decode and load
    coord = saved(job, folder, signing_key="k1", verify_on_load=False)
    try:
        with pytest.raises(CheckpointCorruptError, match=os.path.basename(victim)):
            asyncio.run(coord.load())
    finally:
        coord.close()


def test_allow_unsigned_never_admits_an_unsigned_step_after_a_signed_one(job, tmp_path):
    folder = str(tmp_path / "ckpt")
    coord = saved(job, folder)  # saved before signing was turned on: may be admitted
    asyncio.run(coord.save(1))
    coord.close()
    coord = saved(job, folder, signing_key="k1")
    asyncio.run(coord.save(2))
    coord.close()
    coord = saved(job, folder)  # planted: an unsigned step newer than every signed one
    asyncio.run(coord.save(3))
    coord.close()

    coord = saved(job, folder, signing_key="k1", allow_unsigned=True)
    try:
        with pytest.raises(CheckpointSignatureError, match="step 3 is not signed, but step 2"):
            asyncio.run(coord.load())
        assert asyncio.run(coord.load(step=2)).step == 2  # the signed step still loads
        assert asyncio.run(coord.load(step=1)).step == 1  # older than any signed step: admitted
    finally:
        coord.close()
    coord = saved(job, folder, signing_key="k1")  # without allow_unsigned: refused as before
    try:
        with pytest.raises(CheckpointSignatureError, match="not signed"):
            asyncio.run(coord.load(step=1))
    finally:
        coord.close()
