"""The commit protocol, the definition of a committed step, retention and the folder lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from forge_ckpt import layout
from forge_ckpt.commit import (
    RetentionPolicy,
    apply_retention,
    commit_step,
    prepare_step,
    remove_step,
    remove_uncommitted,
)
from forge_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointLockedError,
    CheckpointSaveError,
    InvalidNameError,
)
from forge_ckpt.lock import FolderLock
from forge_ckpt.storage import write_file


def make_step(folder: str, step: int, commit: bool = True) -> str:
    path = prepare_step(folder, step)
    size, crc = write_file(os.path.join(path, "actors/a.0.msgpack"), b"x" * (step + 1))
    rec = layout.FileRecord("actors/a.0.msgpack", size, crc)
    manifest = layout.Manifest(step, {"a": layout.Component("actor", 1, [rec])}, extra={"s": step})
    if commit:
        commit_step(path, manifest)
    return path


def test_only_marked_steps_exist(tmp_path):
    folder = str(tmp_path)
    make_step(folder, 1)
    make_step(folder, 2, commit=False)
    assert layout.all_steps(folder) == [1, 2]
    assert layout.committed_steps(folder) == [1]
    m = layout.read_committed(layout.step_dir(folder, 1))
    assert m.step == 1 and m.extra == {"s": 1} and m.files[0].size == 2


def test_marker_must_match_manifest(tmp_path):
    folder = str(tmp_path)
    path = make_step(folder, 3)
    with open(os.path.join(path, layout.MANIFEST), "ab") as f:
        f.write(b" ")
    with pytest.raises(CheckpointCorruptError, match="manifest.json: manifest crc32c"):
        layout.read_committed(path)
    assert layout.committed_steps(folder) == []


def test_marker_of_other_step_is_refused(tmp_path):
    folder = str(tmp_path)
    a, b = make_step(folder, 1), make_step(folder, 2)
    for name in (layout.MANIFEST, layout.MARKER):  # a consistent pair, but for step 2
        os.replace(os.path.join(b, name), os.path.join(a, name))
    assert layout.committed_steps(folder) == []


def test_commit_refuses_missing_or_short_files(tmp_path):
    folder = str(tmp_path)
    path = prepare_step(folder, 5)
    rec = layout.FileRecord("actors/a.0.msgpack", 10, "00000000")
    manifest = layout.Manifest(5, {"a": layout.Component("actor", 1, [rec])})
    with pytest.raises(CheckpointSaveError, match="does not exist"):
        commit_step(path, manifest)
    write_file(os.path.join(path, rec.path), b"short")
    with pytest.raises(CheckpointSaveError, match="has 5 bytes, its writer reported 10"):
        commit_step(path, manifest)
    assert not os.path.exists(os.path.join(path, layout.MARKER))


def test_prepare_refuses_committed_and_clears_leftover(tmp_path):
    folder = str(tmp_path)
    make_step(folder, 1)
    with pytest.raises(CheckpointSaveError, match="already committed"):
        prepare_step(folder, 1)
    leftover = make_step(folder, 2, commit=False)
    open(os.path.join(leftover, "junk"), "w").close()
    prepare_step(folder, 2)
    assert sorted(os.listdir(leftover)) == ["actors", "trainer"]


def test_remove_uncommitted(tmp_path):
    folder = str(tmp_path)
    make_step(folder, 1)
    make_step(folder, 2, commit=False)
    open(os.path.join(folder, "x.tmp.123"), "w").close()
    assert remove_uncommitted(folder) == [2]
    assert layout.all_steps(folder) == [1]
    assert not os.path.exists(os.path.join(folder, "x.tmp.123"))


@pytest.mark.parametrize(
    "policy, committed, deleted",
    [
        (RetentionPolicy(keep_last=2), [1, 2, 3, 4], [1, 2]),
        (RetentionPolicy(keep_last=1), [7], []),
        (RetentionPolicy(keep_last=2, keep_every=10), [5, 10, 15, 20, 25], [5, 15]),
        (RetentionPolicy(keep_last=None), [1, 2, 3], []),
    ],
)
def test_retention_policy(policy, committed, deleted):
    assert policy.to_delete(committed) == deleted


def test_apply_retention_removes_marker_first(tmp_path, monkeypatch):
    folder = str(tmp_path)
    for s in (1, 2, 3):
        make_step(folder, s)
    import shutil

    seen = []
    real = shutil.rmtree

    def spy(path, *a, **k):  # by the time files go, the marker must already be gone
        seen.append(os.path.exists(os.path.join(path, layout.MARKER)))
        return real(path, *a, **k)

    monkeypatch.setattr(shutil, "rmtree", spy)
    assert apply_retention(folder, RetentionPolicy(keep_last=1)) == [1, 2]
    assert seen and not any(seen)
    assert layout.committed_steps(folder) == [3]


def test_remove_step_is_never_half_loadable(tmp_path, monkeypatch):
    import shutil

    folder = str(tmp_path)
    path = make_step(folder, 4)

    def failing_rmtree(p, ignore_errors=False, **k):  # deletion of the files fails midway
        if not ignore_errors:
            raise OSError(5, "Input/output error")

    monkeypatch.setattr(shutil, "rmtree", failing_rmtree)
    with pytest.raises(OSError):
        remove_step(path)
    assert os.path.exists(os.path.join(path, layout.MANIFEST))
    assert layout.committed_steps(folder) == []  # the marker went first: never half-loadable


@pytest.mark.parametrize("name", ["", "a/b", "..", "../x", "a\\b", ".hidden", "trainer", "a..b", 3])
def test_invalid_names(name):
    with pytest.raises(InvalidNameError):
        layout.check_name(name)


def test_lock_refuses_second_holder(tmp_path):
    a, b = FolderLock(str(tmp_path)), FolderLock(str(tmp_path))
    a.acquire()
    with pytest.raises(CheckpointLockedError, match=rf"pid {os.getpid()}, started"):
        b.acquire()
    a.release()
    b.acquire()
    b.release()


def test_lock_of_dead_holder_is_taken_over(tmp_path):
    code = (
        "import sys, time; from forge_ckpt.lock import FolderLock; "
        "FolderLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE)
    assert child.stdout.readline().strip() == b"held"
    with pytest.raises(CheckpointLockedError, match=f"pid {child.pid}"):
        FolderLock(str(tmp_path)).acquire()
    child.kill()
    child.wait()
    lock = FolderLock(str(tmp_path))
    lock.acquire()  # the kernel released the dead holder's flock
    info = json.loads(open(os.path.join(tmp_path, layout.LOCK)).read())
    assert info["pid"] == os.getpid() and info["started"] <= time.time()
    lock.release()
