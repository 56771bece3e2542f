"""The commit protocol, the definition of a committed step, retention and the folder's lease,
on a local folder and on S3 (the same tests against both storages)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from forge_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointLockedError,
    CheckpointSaveError,
    InvalidNameError,
)
from forge_ckpt.steps import layout
from forge_ckpt.steps.commit import (
    RetentionPolicy,
    apply_retention,
    commit_step,
    prepare_step,
    quarantine_step,
    remove_step,
    remove_uncommitted,
    retire_after,
)
from forge_ckpt.steps.lock import Lease
from forge_ckpt.storage import open_storage


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return open_storage(str(tmp_path))
    s3 = request.getfixturevalue("s3_folder")
    return open_storage(s3.url, s3.options)


def make_step(store, step: int, commit: bool = True) -> None:
    prepare_step(store, step)
    rec = store.sub(layout.step_name(step)).write("actors/a.0.msgpack", b"x" * (step + 1))
    manifest = layout.Manifest(step, {"a": layout.Component("actor", 1, [rec])}, extra={"s": step})
    if commit:
        commit_step(store, manifest)


def test_only_marked_steps_exist(store):
    make_step(store, 1)
    make_step(store, 2, commit=False)
    assert layout.all_steps(store) == [1, 2]
    assert layout.committed_steps(store) == [1]
    m = layout.read_committed(store, 1)
    assert m.step == 1 and m.extra == {"s": 1} and m.files[0].size == 2


def test_marker_must_match_manifest(store):
    make_step(store, 3)
    data = store.read("step-3/manifest.json")
    store.delete("step-3/manifest.json")
    store.write("step-3/manifest.json", bytes(data) + b" ")
    with pytest.raises(CheckpointCorruptError, match="manifest.json: manifest crc32c"):
        layout.read_committed(store, 3)
    assert layout.committed_steps(store) == []


def test_marker_of_other_step_is_refused(store):
    make_step(store, 1)
    make_step(store, 2)
    for name in (layout.MANIFEST, layout.MARKER):  # a consistent pair, but for step 2
        store.write(f"step-1/{name}", bytes(store.read(f"step-2/{name}")))
    assert layout.committed_steps(store) == [2]


def test_manifest_paths_must_stay_in_the_step(store):
    make_step(store, 1)
    bad = layout.FileRecord("../../etc/passwd", 1, "00000000")
    manifest = layout.Manifest(2, {"a": layout.Component("actor", 1, [bad])})
    prepare_step(store, 2)
    commit_step(store, manifest)
    with pytest.raises(CheckpointCorruptError, match="not a plain relative path"):
        layout.read_committed(store, 2)


def test_two_writers_committing_the_same_step_one_wins(store):
    prepare_step(store, 5)
    rec = store.sub("step-5").write("actors/a.0.msgpack", b"abc")
    results = []

    def commit(tag: str) -> None:
        m = layout.Manifest(5, {"a": layout.Component("actor", 1, [rec])}, extra=tag)
        try:
            commit_step(store, m)
            results.append(("won", tag))
        except CheckpointSaveError as e:
            results.append(("lost", str(e)))

    threads = [threading.Thread(target=commit, args=(t,)) for t in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r[0] for r in results) == ["lost", "won"]
    lost = next(r[1] for r in results if r[0] == "lost")
    assert "another writer is committing the same step" in lost
    winner = next(r[1] for r in results if r[0] == "won")
    assert layout.read_committed(store, 5).extra == winner


def test_prepare_refuses_committed_and_clears_leftover(store):
    make_step(store, 1)
    with pytest.raises(CheckpointSaveError, match="already committed"):
        prepare_step(store, 1)
    make_step(store, 2, commit=False)
    store.write("step-2/junk", b"j")
    prepare_step(store, 2)
    assert [p for p, _ in store.walk("step-2")] == []


def test_remove_uncommitted(store):
    make_step(store, 1)
    make_step(store, 2, commit=False)
    store.write(f"{layout.LEASE}.tmp.123.0a1b2c3d", b"")  # a crashed lease renewal's
    store.write("notes.tmp.txt", b"")  # not ours (a folder at a bucket's root shares it)
    assert remove_uncommitted(store) == [2]
    assert layout.all_steps(store) == [1]
    assert not store.exists(f"{layout.LEASE}.tmp.123.0a1b2c3d")
    assert store.exists("notes.tmp.txt")


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


def test_apply_retention_removes_marker_first(store, monkeypatch):
    for s in (1, 2, 3):
        make_step(store, s)
    seen = []
    real = store.delete_prefix

    def spy(prefix):  # by the time files go, the marker must already be gone
        seen.append(store.exists(f"{prefix}/{layout.MARKER}"))
        return real(prefix)

    monkeypatch.setattr(store, "delete_prefix", spy)
    assert apply_retention(store, RetentionPolicy(keep_last=1)) == [1, 2]
    assert seen and not any(seen)
    assert layout.committed_steps(store) == [3]


def test_remove_step_is_never_half_loadable(store, monkeypatch):
    make_step(store, 4)

    def failing(prefix):  # deletion of the files fails midway
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store, "delete_prefix", failing)
    with pytest.raises(OSError):
        remove_step(store, 4)
    assert store.exists("step-4/manifest.json")
    assert layout.committed_steps(store) == []  # the marker went first: never half-loadable


def test_quarantine_and_retire(store):
    for s in (1, 2, 3):
        make_step(store, s)
    dest = quarantine_step(store, 3)
    assert layout.committed_steps(store) == [1, 2]
    assert layout.quarantined(store) == [dest.split("/")[-1]]
    make_step(store, 3)  # the same step number can be committed again
    assert retire_after(store, 1) == [2, 3]
    assert layout.committed_steps(store) == [1]


def test_listing_past_1000_entries(store):
    prepare_step(store, 1)
    sub = store.sub("step-1")
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: sub.write(f"actors/f{i:05d}", b"."), range(1500)))
    assert len(sub.walk("actors")) == 1500
    assert len(sub.list("actors")) == 1500


@pytest.mark.parametrize("name", ["", "a/b", "..", "../x", "a\\b", ".hidden", "trainer", "a..b", 3])
def test_invalid_names(name):
    with pytest.raises(InvalidNameError):
        layout.check_name(name)


# ---- the lease ----------------------------------------------------------------------------


def test_lease_refuses_second_holder_and_release_hands_over(store):
    a, b = Lease(store), Lease(store)
    a.acquire()
    with pytest.raises(CheckpointLockedError, match=rf"pid {os.getpid()}, started"):
        b.acquire()
    a.release()
    b.acquire()
    assert b.generation == a.generation + 1
    b.release()


def test_expired_lease_is_taken_over_and_the_stale_holder_cannot_renew(store):
    now = [1_000_000.0]
    a = Lease(store, ttl_s=60, clock=lambda: now[0], renew_in_background=False)
    a.acquire()
    b = Lease(store, ttl_s=60, clock=lambda: now[0], renew_in_background=False)
    with pytest.raises(CheckpointLockedError, match="in use by"):
        b.acquire()
    now[0] += 61  # a stalled holder: no renewals past its expiry
    b.acquire()
    assert b.generation == a.generation + 1
    with pytest.raises(CheckpointLockedError, match="lost the lease"):
        a.renew()
    with pytest.raises(CheckpointLockedError, match="lost the lease"):
        a.check()  # what the commit asks before its marker
    b.release()


def test_lease_of_dead_local_holder_is_taken_over_at_once(tmp_path):
    code = (
        "import sys, time; from forge_ckpt.steps.lock import Lease; from forge_ckpt.storage import "
        "open_storage; Lease(open_storage(sys.argv[1]), ttl_s=600).acquire(); "
        "print('held', flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE)
    assert child.stdout.readline().strip() == b"held"
    store = open_storage(str(tmp_path))
    with pytest.raises(CheckpointLockedError, match=f"pid {child.pid}"):
        Lease(store).acquire()
    child.kill()
    child.wait()
    lease = Lease(store)
    lease.acquire()  # its process is gone: no need to wait 600 s for the expiry
    info = json.loads(open(os.path.join(tmp_path, layout.LEASE)).read())
    assert info["pid"] == os.getpid() and info["generation"] == 2
    lease.release()
