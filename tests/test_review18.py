"""Review 18, of per-attempt actor file names (held storage, real threads):

1. An aborted save attempt's actor write that lands after the same step number was saved
   again and committed lands beside the committed file (it cannot damage it), but nothing
   removed it: `forge-ckpt gc` said "nothing to remove" and a copy of the actor's state stayed
   in the step. gc removes files a committed step's manifest does not name.
2. A component named "buf\\n" was accepted (`$` matches before a final newline) and saved,
   and its step could not be loaded: names are matched whole now.
3. A manifest that records two replicas but names a file for one said "register as many
   replicas as were saved" (a mismatch, which `fallback` does not pass over): it is a damaged
   step, reported as one, naming the replicas without a file.

Review 19, of review 18's gc (fresh-context, small programs):

4. gc took every file a committed manifest does not name for a stray: with the manifest of
   claim 3 it deleted the only copy of replica 1, and it read a signed step's manifest
   without the signing key, acting on an altered one. gc now removes only a replica's file
   of another save attempt where the manifest names that replica's file, and reads
   manifests with the configured keys (a step whose signature fails is left alone).
5. gc deleted every top-level name with ".tmp." in it: at a bucket's root, other owners'
   objects. It removes only a crashed lease renewal's temp file (test_layout_commit.py).
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from _held_storage import WAIT_S, Clock, Comp, Handle, held_rules, hold, job  # noqa: F401
from typer.testing import CliRunner

from forge_ckpt import CheckpointConfig, CheckpointCoordinator
from forge_ckpt.cli import app
from forge_ckpt.errors import CheckpointCorruptError, CheckpointSaveError, InvalidNameError
from forge_ckpt.steps import layout
from forge_ckpt.storage import crc32c_of_bytes

pytestmark = pytest.mark.usefixtures("held_rules")


async def until(cond: object, what: str) -> None:
    """Wait (bounded) until `cond()` holds: a write in another thread has landed."""
    for _ in range(int(WAIT_S / 0.01)):
        if cond():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def test_gc_removes_an_aborted_attempts_late_file_from_a_committed_step(tmp_path):
    clock = Clock()
    a = job(tmp_path, clock, "host-a", lease_ttl_s=60.0, keep_last=None, save_timeout_s=1.0,
            abort_timeout_s=0.5)  # fmt: skip
    a.register("c0", Handle(comp := Comp(101)))
    assert (await a.save(1)).committed
    late = hold("writer", "step-2/actors/c0.0.msgpack")
    with pytest.raises(CheckpointSaveError, match="save_timeout_s"):
        await a.save(2)  # its write is held: the attempt times out and is aborted
    await late.reached()
    comp.version = 102
    assert (await a.save(2)).committed  # the next attempt commits step 2
    actors = tmp_path / "step-2" / "actors"
    late.go.set()
    await until(lambda: len(os.listdir(actors)) == 2, "the aborted attempt's write landed")
    named = [f.path for f in layout.read_committed(str(tmp_path), 2).files]
    assert len(named) == 1 and named[0].startswith("actors/c0.0.")
    a.close()
    out = CliRunner().invoke(app, ["gc", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert "removed 1 stray file(s)" in out.output
    assert [f"actors/{n}" for n in os.listdir(actors)] == named  # the committed file stays
    b = CheckpointCoordinator(CheckpointConfig(folder=str(tmp_path), keep_last=None))
    b.register("c0", Handle(comp := Comp(0)))
    assert (await b.load()).step == 2 and comp.version == 102
    b.close()


def test_a_name_with_a_trailing_newline_is_refused(tmp_path):
    c = CheckpointCoordinator(CheckpointConfig(folder=str(tmp_path)))
    try:
        with pytest.raises(InvalidNameError, match="invalid component name"):
            c.register("buf\n", Handle(Comp(1)))
    finally:
        c.close()


async def test_a_manifest_without_a_replicas_file_is_a_damaged_step(tmp_path):
    folder = str(tmp_path)
    c = CheckpointCoordinator(CheckpointConfig(folder=folder, keep_last=None))
    c.register("buf", [Handle(Comp(1)), Handle(Comp(2))])
    await c.save(1)
    c.close()
    step = layout.step_dir(folder, 1)  # replica 1's file taken out, manifest and marker agree
    with open(os.path.join(step, layout.MANIFEST)) as f:
        manifest = json.load(f)
    manifest["components"]["buf"]["files"].pop(1)
    raw = json.dumps(manifest).encode()
    with open(os.path.join(step, layout.MANIFEST), "wb") as f:
        f.write(raw)
    marker = layout.marker_bytes(1, crc32c_of_bytes(raw), manifest.get("generation", 0))
    with open(os.path.join(step, layout.MARKER), "wb") as f:
        f.write(marker)
    before = sorted(os.listdir(os.path.join(step, "actors")))
    out = CliRunner().invoke(app, ["gc", folder])  # claim 4: no replica's only copy goes
    assert out.exit_code == 0 and "nothing to remove" in out.output, out.output
    assert sorted(os.listdir(os.path.join(step, "actors"))) == before and len(before) == 2
    for kw in ({}, {"reshard": lambda states, n: [states[0]] * n}):
        c = CheckpointCoordinator(CheckpointConfig(folder=folder, keep_last=None))
        c.register("buf", [Handle(Comp(0)), Handle(Comp(0))], **kw)
        try:
            with pytest.raises(
                CheckpointCorruptError, match=r"names no file for replica\(s\) \[1\]"
            ):
                await c.load(step=1)
        finally:
            c.close()


def rewrite(step: str, manifest: dict, signature: str | None) -> None:
    """Replace a step's manifest and a marker that matches it, keeping `signature`."""
    raw = json.dumps(manifest).encode()
    with open(os.path.join(step, layout.MANIFEST), "wb") as f:
        f.write(raw)
    marker = layout.marker_bytes(
        int(manifest["step"]), crc32c_of_bytes(raw), manifest.get("generation", 0), signature
    )
    with open(os.path.join(step, layout.MARKER), "wb") as f:
        f.write(marker)


async def test_gc_leaves_a_signed_step_whose_manifest_was_altered(tmp_path, monkeypatch):
    """Claim 4: the manifest names a planted file of another attempt for c0's replica 0 (its
    signature kept): read without the key, the real file would be the stray."""
    key = "k" * 32
    monkeypatch.setenv("FORGE_CKPT_SIGNING_KEY", key)
    folder = str(tmp_path)
    c = CheckpointCoordinator(CheckpointConfig(folder=folder, keep_last=None, signing_key=key))
    c.register("c0", Handle(Comp(1)))
    await c.save(1)
    c.close()
    step = layout.step_dir(folder, 1)
    with open(os.path.join(step, layout.MANIFEST)) as f:
        manifest = json.load(f)
    with open(os.path.join(step, layout.MARKER)) as f:
        signature = json.load(f).get("signature")
    assert signature is not None
    real = manifest["components"]["c0"]["files"][0]["path"]
    planted = layout.actor_file("c0", 0, layout.attempt_name(9, 9))
    with open(os.path.join(step, real), "rb") as src, open(os.path.join(step, planted), "wb") as f:
        f.write(src.read())
    manifest["components"]["c0"]["files"][0]["path"] = planted
    rewrite(step, manifest, signature)
    out = CliRunner().invoke(app, ["gc", folder])
    assert out.exit_code == 0 and "nothing to remove" in out.output, out.output
    assert os.path.exists(os.path.join(step, real)) and os.path.exists(os.path.join(step, planted))
