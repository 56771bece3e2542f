"""The storage seam's contract, run against both implementations: a local folder and a real S3
server (SeaweedFS). Everything forge_ckpt writes or reads goes through these calls."""

from __future__ import annotations

import os
import pickle

import pytest

from forge_ckpt.errors import CheckpointCorruptError
from forge_ckpt.storage import (
    AlreadyExistsError,
    FileRecord,
    PreconditionFailedError,
    StorageSpec,
    crc32c_of_bytes,
    open_storage,
)

MIB = 1024 * 1024


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        local = open_storage(str(tmp_path / "root"))
        local.makedirs("")  # the coordinator does this when it opens a folder
        return local
    s3 = request.getfixturevalue("s3_folder")
    # small parts, so that multipart uploads and parallel ranged reads are exercised
    return open_storage(s3.url, {**s3.options, "part_size_mb": 5, "max_concurrency": 3})


def test_writer_checksums_while_writing(store):
    store.makedirs("d")
    data = os.urandom(13 * MIB + 7)  # three parts and a bit on S3
    with store.writer("d/big") as w:
        for i in range(0, len(data), 3 * MIB):
            w.write(data[i : i + 3 * MIB])
        rec = w.close()
    assert rec == FileRecord("d/big", len(data), crc32c_of_bytes(data))
    assert store.size("d/big") == len(data)
    assert bytes(store.read("d/big")) == data
    assert bytes(store.read("d/big", 5 * MIB - 3, 10 * MIB + 2)) == data[5 * MIB - 3 : 10 * MIB + 2]
    assert bytes(store.read("d/big", len(data) - 4, len(data) + 100)) == data[-4:]
    store.verify("d/big", rec)
    assert bytes(store.read_verified("d/big", rec)) == data


def test_small_and_empty_objects(store):
    assert store.write("empty", b"") == FileRecord("empty", 0, crc32c_of_bytes(b""))
    assert bytes(store.read("empty")) == b""
    store.write("tiny", b"abc")
    assert bytes(store.read("tiny", 0, 4096)) == b"abc"


def test_verify_names_the_damage(store):
    rec = store.write("f", b"hello world")
    with pytest.raises(CheckpointCorruptError, match="size is 11 bytes, the manifest says 12"):
        store.verify("f", FileRecord("f", 12, rec.crc32c))
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        store.read_verified("f", FileRecord("f", 11, "00000000"))
    with pytest.raises(CheckpointCorruptError, match="missing"):
        store.verify("nope", rec)


def test_read_buffer_is_the_verified_bytes_and_writable(store):
    data = os.urandom(5 * MIB + 3)  # big enough for the local storage's anonymous-map buffer
    rec = store.write("b", data)
    buf = store.read_buffer("b", rec)
    assert bytes(buf) == data and not buf.readonly
    buf[0] ^= 1  # decoded arrays are views of it and may be written
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        store.read_buffer("b", FileRecord("b", len(data), "00000000"))
    with pytest.raises(CheckpointCorruptError, match="size is"):
        store.read_buffer("b", FileRecord("b", len(data) + 1, rec.crc32c))
    with pytest.raises(CheckpointCorruptError, match="missing"):
        store.read_buffer("nope", rec)


def test_missing_objects(store):
    assert store.size("nope") is None and not store.exists("nope")
    assert store.read_tagged("nope") is None
    with pytest.raises(FileNotFoundError):
        store.read("nope")
    store.delete("nope")  # fine


def test_aborted_writer_leaves_nothing(store):
    with pytest.raises(RuntimeError):
        with store.writer("partial") as w:
            w.write(os.urandom(11 * MIB))  # some parts already uploaded on S3
            raise RuntimeError("the writer's process failed")
    assert not store.exists("partial")
    assert store.abort_uploads("") == 0  # and no multipart upload left behind


@pytest.mark.parametrize("size", [100, 11 * MIB])  # one PUT; a multipart upload on S3
def test_an_exclusive_writer_never_replaces_a_file(store, size):
    """A step's data files are written exclusively: a stale writer's late write fails and
    leaves the successor's file whole (it truncated or replaced it), whichever came first."""
    store.makedirs("d")
    first = os.urandom(size)
    rec = store.write("d/f", first)
    late = store.writer("d/f", exclusive=True) if store.local_path() is None else None
    if late is not None:  # S3: the condition is checked when the object is completed
        late.write(os.urandom(size))
        with pytest.raises(AlreadyExistsError, match="another writer"):
            late.close()
        late.abort()
    else:  # POSIX: at open, before a byte is written (O_TRUNC truncated the file here)
        with pytest.raises(AlreadyExistsError, match="another writer"):
            store.writer("d/f", exclusive=True)
    store.verify("d/f", rec)
    again = store.writer("d/g", exclusive=True)
    again.write(first)
    assert again.close().crc32c == rec.crc32c


def test_an_aborted_late_writer_removes_only_its_own_file(tmp_path):
    """POSIX: a stale writer opened its file before the successor removed the folder and wrote
    its own under the same name; the stale writer's abort must not unlink the successor's."""
    store = open_storage(str(tmp_path))
    store.makedirs("step-1")
    stale = store.writer("step-1/a", exclusive=True)
    stale.write(b"stale")
    store.delete_prefix("step-1")  # the successor prepares the step
    store.makedirs("step-1")
    rec = store.write("step-1/a", b"successor")
    stale.abort()
    store.verify("step-1/a", rec)


def test_create_is_exclusive_and_replace_is_compare_and_swap(store):
    tag = store.create("lease", b"one")
    with pytest.raises(AlreadyExistsError):
        store.create("lease", b"two")
    assert store.read_tagged("lease") == (b"one", tag)
    tag2 = store.replace("lease", b"two", tag)
    with pytest.raises(PreconditionFailedError):
        store.replace("lease", b"three", tag)  # a stale version
    assert store.read_tagged("lease") == (b"two", tag2)
    with pytest.raises(PreconditionFailedError):
        store.replace("gone", b"x", tag2)


def test_publish_replaces_whole(store):
    store.publish("p", b"old")
    store.publish("p", b"new content")
    assert bytes(store.read("p")) == b"new content"


def test_list_walk_delete_and_move(store):
    for path in ("a/1", "a/2", "a/sub/3", "b/4", "top"):
        store.makedirs(os.path.dirname(path))
        store.write(path, path.encode())
    assert store.list("") == ["a", "b", "top"]
    assert store.list("a") == ["1", "2", "sub"]
    assert store.walk("a") == [("a/1", 3), ("a/2", 3), ("a/sub/3", 7)]
    store.move_prefix("a", "moved/a", first="a/2")
    assert store.walk("moved") == [("moved/a/1", 3), ("moved/a/2", 3), ("moved/a/sub/3", 7)]
    assert store.walk("a") == []
    store.delete_prefix("moved")
    store.delete("top")
    assert store.list("") == ["b"]


def test_rename(store):
    store.makedirs("d")
    store.write("d/.metadata.tmp", b"dcp metadata")
    store.rename("d/.metadata.tmp", "d/.metadata")
    assert bytes(store.read("d/.metadata")) == b"dcp metadata"
    assert not store.exists("d/.metadata.tmp")
    with pytest.raises(FileNotFoundError):
        store.rename("d/.metadata.tmp", "d/x")


def test_sub_and_spec(store):
    sub = store.sub("x/y")
    sub.makedirs("")
    sub.write("f", b"1")
    assert store.exists("x/y/f") and sub.url.endswith("/x/y")
    spec = pickle.loads(pickle.dumps(store.spec))  # what actors receive
    assert open_storage(spec).exists("x/y/f")


def test_secrets_never_shown():
    spec = StorageSpec("s3://b/p", {"aws_secret_access_key": "hunter2", "endpoint_url": "http://e"})
    assert "hunter2" not in repr(spec) and "http://e" in repr(spec)
