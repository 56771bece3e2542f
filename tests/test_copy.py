"""`forge-ckpt copy` / `copy_step`: a committed step into another folder, committed there.

The source is a real signed step (a TorchTitan trainer rank and a Ray actor); copies go
local -> local, local -> S3, S3 -> S3 (another bucket) and S3 -> local on the test SeaweedFS.
A copy SIGKILLed at each point of its protocol (tests/copy_child.py) never leaves a step
that counts, and a second copy completes; a completed copy passes `verify` and loads.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

import pytest
import ray
from typer.testing import CliRunner

import forge_ckpt
from forge_ckpt import (
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLockedError,
    copy_step,
)
from forge_ckpt.cli import app
from forge_ckpt.steps import commit, layout
from forge_ckpt.storage import open_storage

sys.path.insert(0, os.path.dirname(__file__))
from _paths import actor_path  # noqa: E402
from copy_child import POINTS  # noqa: E402
from crash_actors import Sampler, make_trainer_ranks  # noqa: E402

CHILD = os.path.join(os.path.dirname(__file__), "copy_child.py")
KEY = "copy-test-key"
STEP = 2


@pytest.fixture(scope="module")
def source(ray_local, tmp_path_factory):
    """A signed folder with steps 1 and 2; returns (folder, the sampler's history at step 2)."""
    path = str(tmp_path_factory.mktemp("copy") / "src")

    async def make():
        coord = CheckpointCoordinator(CheckpointConfig(folder=path, signing_key=KEY))
        sampler = Sampler.remote(3)
        coord.register("sampler", sampler)
        trainer = make_trainer_ranks(1)
        coord.set_trainer(trainer)
        for step in (1, 2):
            await sampler.step.remote()
            await coord.save(step, extra={"policy_version": step})
        coord.close()
        history = await sampler.get_history.remote()
        for a in [sampler, *trainer]:  # the module's tests need their resources
            ray.kill(a)
        return history

    return path, asyncio.run(make())


@pytest.fixture
def keys(monkeypatch):
    """The verification key in the environment, as a user's `forge-ckpt verify` would have."""
    monkeypatch.setenv("FORGE_CKPT_VERIFY_KEYS", KEY)


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def same_files(src: str, dest: str, dest_options: dict | None = None) -> None:
    """Every file of step-2 (manifest included: the signature covers it) is equal byte for byte."""
    a, b = open_storage(src), open_storage(dest, dest_options)
    name = layout.step_name(STEP)
    for path, _ in a.walk(name):
        if not path.endswith(layout.MARKER):
            assert bytes(a.read(path)) == bytes(b.read(path)), path


def test_local_copy_verifies_and_loads(source, tmp_path, keys):
    src, history = source
    dest = str(tmp_path / "dest")
    out = cli("copy", layout.step_dir(src, STEP), dest)
    assert out.exit_code == 0, out.output
    assert f"copied {actor_path(src, STEP, 'sampler')}" in out.output
    assert "committed step 2" in out.output
    assert forge_ckpt.committed_steps(dest) == [STEP]
    same_files(src, dest)
    lease = json.loads(open(os.path.join(dest, layout.LEASE)).read())
    assert lease["released"] and lease["committed"] == {"2": lease["generation"]}
    assert cli("verify", layout.step_dir(dest, STEP)).exit_code == 0

    async def load():
        coord = CheckpointCoordinator(CheckpointConfig(folder=dest, signing_key=KEY))
        sampler = Sampler.remote(99)
        coord.register("sampler", sampler)
        trainer = make_trainer_ranks(1, seed=7)
        coord.set_trainer(trainer)
        result = await coord.load()
        got = await sampler.get_history.remote()
        coord.close()
        for a in [sampler, *trainer]:
            ray.kill(a)
        return result, got

    result, got = asyncio.run(load())
    assert (result.step, result.extra, got) == (STEP, {"policy_version": STEP}, history)


def test_existing_step_is_kept_unless_overwrite(source, tmp_path):
    src, _ = source
    dest = str(tmp_path / "dest")
    copy_step(src, STEP, dest)
    with pytest.raises(CheckpointError, match="already committed.*overwrite=True"):
        copy_step(src, STEP, dest)
    copy_step(src, 1, dest)
    files = len(layout.read_committed(src, STEP).files)
    assert copy_step(src, STEP, dest, overwrite=True, workers=1).files == files
    assert forge_ckpt.committed_steps(dest) == [1, STEP]
    with pytest.raises(ValueError, match="same folder"):
        copy_step(src, STEP, src)


def test_s3_both_ways_and_bucket_to_bucket(source, s3_folder, tmp_path, keys, monkeypatch):
    src, _ = source
    opts = s3_folder.options
    copy_step(src, STEP, s3_folder.url, dest_options=opts)  # local -> S3
    assert forge_ckpt.committed_steps(s3_folder.url, opts) == [STEP]
    other = f"{s3_folder.bucket}-b"
    s3_folder.server.create_bucket(other)
    copy_step(s3_folder.url, STEP, f"s3://{other}/moved", src_options=opts, dest_options=opts)
    back = str(tmp_path / "back")
    copy_step(f"s3://{other}/moved", STEP, back, src_options=opts)  # S3 -> local
    same_files(src, f"s3://{other}/moved", opts)
    same_files(src, back)
    assert cli("verify", layout.step_dir(back, STEP)).exit_code == 0
    for k, v in s3_folder.server.env().items():  # the CLI reads the AWS environment
        monkeypatch.setenv(k, v)
    out = cli("verify", f"s3://{other}/moved/step-{STEP}")
    assert out.exit_code == 0, out.output
    assert opts["aws_secret_access_key"] not in out.output


def test_corrupt_or_uncommitted_source_is_refused(source, tmp_path):
    src = str(tmp_path / "src")
    shutil.copytree(source[0], src)
    path = os.path.join(src, "step-2", actor_path(src, STEP, "sampler"))
    with open(path, "r+b") as f:
        f.seek(200_000)
        byte = f.read(1)
        f.seek(200_000)
        f.write(bytes([byte[0] ^ 1]))
    dest = str(tmp_path / "dest")
    with pytest.raises(CheckpointCorruptError, match=r"sampler\.0\.\S*msgpack.*digest differs"):
        copy_step(src, STEP, dest, workers=1)
    assert layout.all_steps(dest) == [] and forge_ckpt.committed_steps(dest) == []
    out = cli("copy", layout.step_dir(src, STEP), dest)
    assert out.exit_code == 1 and "digest differs" in out.output
    os.makedirs(os.path.join(src, "step-3"))  # a crashed save's leftover
    with pytest.raises(CheckpointCorruptError, match="never committed"):
        copy_step(src, 3, dest)


def test_destination_leased_by_a_live_job_is_refused(source, tmp_path):
    src, _ = source
    dest = str(tmp_path / "dest")
    job = CheckpointCoordinator(CheckpointConfig(folder=dest))
    try:
        with pytest.raises(CheckpointLockedError, match="cannot copy step 2 .* in use by"):
            copy_step(src, STEP, dest)
        out = cli("copy", layout.step_dir(src, STEP), dest)
        assert out.exit_code == 1 and "in use by" in out.output
        assert layout.all_steps(dest) == []
    finally:
        job.close()
    copy_step(src, STEP, dest)
    assert forge_ckpt.committed_steps(dest) == [STEP]


def kill_copy(src: str, dest: str, point: str, options: dict | None = None) -> None:
    env = {**os.environ, "FORGE_CKPT_TEST_DEST_OPTIONS": json.dumps(options or {})}
    proc = subprocess.run(
        [sys.executable, CHILD, src, str(STEP), dest, point],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == -9, f"not killed at {point}:\n{proc.stdout}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("point", POINTS)
def test_killed_copy_never_looks_committed(source, tmp_path, keys, point):
    src, _ = source
    dest = str(tmp_path / "dest")
    kill_copy(src, dest, point)
    assert os.path.isdir(layout.step_dir(dest, STEP))  # it got as far as its files
    if point == "after_record":  # the commit point passed: committed, whole
        assert forge_ckpt.committed_steps(dest) == [STEP]
    else:
        assert forge_ckpt.committed_steps(dest) == [] == layout.marked_steps(dest)
        assert cli("verify", layout.step_dir(dest, STEP)).exit_code == 1
        copy_step(src, STEP, dest)  # the dead copy's lease is taken over at once
    assert cli("verify", layout.step_dir(dest, STEP)).exit_code == 0
    same_files(src, dest)


def test_killed_copy_to_s3_after_its_marker(source, s3_folder, keys):
    src, _ = source
    opts = s3_folder.options
    kill_copy(src, s3_folder.url, "after_marker", opts)
    store = open_storage(s3_folder.url, opts)
    assert store.exists(f"step-{STEP}/{layout.MARKER}")  # there, but not recorded
    assert forge_ckpt.committed_steps(s3_folder.url, opts) == []
    copy_step(src, STEP, s3_folder.url, dest_options=opts)
    assert forge_ckpt.committed_steps(s3_folder.url, opts) == [STEP]
    same_files(src, s3_folder.url, opts)


def test_source_step_removed_while_copied(source, tmp_path):
    """Retention of the job writing the source folder removes the step mid-copy: the error
    says so (not "corrupt"), and nothing is committed at the destination."""
    src = str(tmp_path / "src")
    shutil.copytree(source[0], src)

    def retention(path, size, done, total):  # after the first file
        commit.remove_step(open_storage(src), STEP)

    dest = str(tmp_path / "dest")
    with pytest.raises(CheckpointError, match="was removed while it was copied"):
        copy_step(src, STEP, dest, workers=1, progress=retention)
    assert layout.all_steps(dest) == []
