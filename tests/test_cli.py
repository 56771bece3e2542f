"""The `forge-ckpt` command line on a real folder: list, inspect, verify, gc; their `--json`
reports, `--version` and the progress display."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import version

import pytest
from rich.console import Console
from typer.testing import CliRunner

from forge_ckpt import CheckpointConfig, CheckpointCoordinator
from forge_ckpt.cli import app
from forge_ckpt.steps import layout
from forge_ckpt.tools.progress import progress
from forge_ckpt.tools.report import SCHEMA_VERSION, dumps

sys.path.insert(0, os.path.dirname(__file__))
from _paths import actor_path  # noqa: E402
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
    assert actor_path(folder, 2, "sampler") in out.output


def test_verify_ok_and_uncommitted(folder):
    assert run("verify", layout.step_dir(folder, 1)).exit_code == 0
    out = run("verify", layout.step_dir(folder, 3))
    assert out.exit_code == 1 and "never committed" in out.output


def test_json_list_inspect_verify(folder, tmp_path):
    res = run("list", folder, "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["schema_version"] == SCHEMA_VERSION and report["command"] == "list"
    steps = {s["step"]: s for s in report["steps"]}
    assert steps[2]["committed"] and steps[2]["size"] > 400_000 and steps[2]["created"] > 0
    assert steps[2]["components"]["sampler"] == {"kind": "actor", "replicas": 1}
    assert not steps[3]["committed"] and "never committed" in steps[3]["problem"]

    body = json.loads(run("inspect", layout.step_dir(folder, 2), "--json").stdout)
    assert body["extra"] == {"policy_version": 2} and body["fingerprint"] == "abc123"
    files = {f["path"]: f for c in body["components"].values() for f in c["files"]}
    assert files[".metadata"]["contents"]["0.weight"] == {"dtype": "float32", "shape": [32, 16]}
    assert "ndarray(float32, [100000])" in json.dumps(files[actor_path(folder, 2, "sampler")])

    res = run("verify", layout.step_dir(folder, 1), "--json")
    body = json.loads(res.stdout)
    assert res.exit_code == 0 and body["ok"] and all(f["ok"] for f in body["files"])
    assert "verify step 1: 100%" in res.stderr  # plain progress lines: not a terminal
    res = run("verify", layout.step_dir(folder, 3), "--json")
    assert res.exit_code == 1 and "never committed" in json.loads(res.stdout)["error"]

    copy = tmp_path / "ckpt"
    shutil.copytree(layout.step_dir(folder, 1), copy / "step-1")
    rel = actor_path(folder, 1, "sampler")
    with open(copy / "step-1" / rel, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"xxxxxxxx")
    res = run("verify", str(copy / "step-1"), "--json")
    bad = [f for f in json.loads(res.stdout)["files"] if not f["ok"]]
    assert res.exit_code == 1 and [f["path"] for f in bad] == [rel]
    assert "crc32c" in bad[0]["problem"]


def test_version_and_progress_display():
    res = run("--version")
    assert res.exit_code == 0 and res.stdout.strip() == f"forge-ckpt {version('forge_ckpt')}"
    plain = Console(file=io.StringIO(), force_terminal=False)
    with progress("export step 7", plain) as advance:
        for done in range(0, 101, 5):
            advance(done, 100)
    lines = plain.file.getvalue().splitlines()
    assert lines[0].startswith("export step 7: 0%") and lines[-1].startswith("export step 7: 100%")
    assert len(lines) == 11  # one line per tenth, however often it is called
    tty = Console(file=io.StringIO(), force_terminal=True, width=100)
    with progress("verify step 7", tty) as advance:
        advance(50, 100)
    assert "verify step 7" in tty.file.getvalue() and "\x1b[" in tty.file.getvalue()  # a bar


def test_json_report_encodes_what_json_cannot():
    """Actor state may hold tuple or bytes keys and NaN: the report stays valid JSON."""
    text = dumps("inspect", {"extra": {(1, 2): b"x", "loss": [float("nan"), float("-inf"), 0.5]}})
    body = json.loads(text)  # strict JSON: no NaN literal
    assert "NaN" not in text and body["extra"] == {"(1, 2)": "b'x'", "loss": ["nan", "-inf", 0.5]}


def test_gc_removes_leftover_only_and_console_script_works(folder):
    out = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "forge-ckpt"), "gc", folder],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "removed 1 uncommitted step(s): [3]" in out.stdout
    assert layout.all_steps(folder) == [1, 2] == layout.committed_steps(folder)
