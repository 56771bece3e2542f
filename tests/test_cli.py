"""The `forge-ckpt` command line on a real folder: list, inspect, verify, gc."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from forge_ckpt import CheckpointConfig, CheckpointCoordinator, layout
from forge_ckpt.cli import app

sys.path.insert(0, os.path.dirname(__file__))
from crash_actors import Sampler, make_trainer_ranks  # noqa: E402


@pytest.fixture(scope="module")
def folder(ray_local, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli") / "ckpt")

    async def make():
        coord = CheckpointCoordinator(CheckpointConfig(folder=path, fingerprint="abc123"))
        coord.register("sampler", Sampler.remote(1))
        coord.set_trainer(make_trainer_ranks(1))
        await coord.save(1, extra={"policy_version": 1})
        await coord.save(2, extra={"policy_version": 2})
        coord.close()

    asyncio.run(make())
    os.makedirs(os.path.join(path, "step-3", "actors"))  # a crash leftover
    return path


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_list_shows_committed_and_leftover(folder):
    out = run("list", folder)
    assert out.exit_code == 0, out.output
    lines = {
        line.split()[1]: line
        for line in out.output.splitlines()
        if line.split()[1:2] and line.split()[1].isdigit()
    }
    assert "yes" in lines["1"] and "sampler×1" in lines["2"] and "trainer×1" in lines["2"]
    assert "no" in lines["3"] and "never committed" in lines["3"]


def test_inspect_shows_shapes_and_dtypes(folder):
    out = run("inspect", layout.step_dir(folder, 2))
    assert out.exit_code == 0, out.output
    assert "fingerprint abc123" in out.output and "'policy_version': 2" in out.output
    assert "0.weight: tensor(float32, [32, 16])" in out.output  # from DCP's .metadata
    assert "ndarray(float32, [100000])" in out.output  # from the actor file
    assert "actors/sampler.0.msgpack" in out.output


def test_verify_ok_and_uncommitted(folder):
    assert run("verify", layout.step_dir(folder, 1)).exit_code == 0
    out = run("verify", layout.step_dir(folder, 3))
    assert out.exit_code == 1 and "never committed" in out.output


def test_gc_removes_leftover_only_and_console_script_works(folder):
    out = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "forge-ckpt"), "gc", folder],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "removed 1 uncommitted step(s): [3]" in out.stdout
    assert layout.all_steps(folder) == [1, 2] == layout.committed_steps(folder)
