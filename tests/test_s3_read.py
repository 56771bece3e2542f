"""S3 reads of large objects: every part asked for at once and read straight into one buffer,
the checksum over the parts in order as they arrive (`S3Storage.read_verified`). What must hold:
the bytes are the object's, and damage, a replaced object or a cut connection is an error that
names the object, never a short or mixed buffer."""

from __future__ import annotations

import os

import pytest
from s3proxy import FaultProxy

from forge_ckpt.errors import CheckpointCorruptError
from forge_ckpt.storage import FileRecord, StorageError, open_storage

MIB = 1024 * 1024
PART_MB = 5


def _store(url: str, options: dict, **more: object):
    return open_storage(url, {**options, "part_size_mb": PART_MB, "max_concurrency": 3, **more})


@pytest.fixture
def s3(s3_folder):
    return _store(s3_folder.url, s3_folder.options)


def test_many_parts_come_back_whole_and_checked(s3):
    data = os.urandom(4 * PART_MB * MIB + 11)  # five parts, the last one short
    rec = s3.write("obj", data)
    assert bytes(s3.read_verified("obj", rec)) == data
    assert bytes(s3.read_buffer("obj", rec)) == data
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        s3.read_verified("obj", FileRecord("obj", len(data), "00000000"))
    for size in (len(data) - 1, len(data) + 1, len(data) + PART_MB * MIB):
        with pytest.raises(CheckpointCorruptError, match=f"size is {len(data)} bytes"):
            s3.read_verified("obj", FileRecord("obj", size, rec.crc32c))
    with pytest.raises(CheckpointCorruptError, match="missing"):
        s3.read_verified("nope", rec)


def test_an_object_replaced_after_its_record_is_refused(s3):
    data = os.urandom(3 * PART_MB * MIB)
    rec = s3.write("obj", data)
    s3.write("obj", os.urandom(len(data)))  # same size, other bytes
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        s3.read_verified("obj", rec)
    s3.write("obj", data + b"more")  # the old bytes, and more
    with pytest.raises(CheckpointCorruptError, match=f"size is {len(data) + 4} bytes"):
        s3.read_verified("obj", rec)


@pytest.mark.parametrize("after", [100, 2 * MIB])  # inside the reply's head; mid-body
def test_a_reply_cut_off_is_an_error_naming_the_object(s3_folder, after):
    data = os.urandom(3 * PART_MB * MIB)
    rec = _store(s3_folder.url, s3_folder.options).write("obj", data)
    with FaultProxy(s3_folder.server.endpoint) as proxy:
        store = _store(s3_folder.url, s3_folder.options, endpoint_url=proxy.endpoint,
                       max_attempts=1)  # fmt: skip
        proxy.cut_reply(r"/obj$", "GET", after)
        with pytest.raises(StorageError, match=r"ckpt/obj: read"):
            store.read_verified("obj", rec)
        assert bytes(store.read_verified("obj", rec)) == data  # the client is not left broken
        proxy.cut_reply(r"/obj$", "GET", after)
        with pytest.raises(StorageError, match=r"ckpt/obj: read"):
            store.read("obj")
        assert bytes(store.read("obj")) == data


def test_parts_the_server_keeps_refusing_fail_the_read(s3_folder):
    data = os.urandom(3 * PART_MB * MIB)
    rec = _store(s3_folder.url, s3_folder.options).write("obj", data)
    with FaultProxy(s3_folder.server.endpoint) as proxy:
        store = _store(s3_folder.url, s3_folder.options, endpoint_url=proxy.endpoint,
                       max_attempts=2)  # fmt: skip
        proxy.fail_matching(r"/obj$", "GET", 10**6, 500, "InternalError")  # every try
        with pytest.raises(StorageError, match=r"ckpt/obj: read failed after retries"):
            store.read_verified("obj", rec)
        proxy.clear()
        assert bytes(store.read_verified("obj", rec)) == data


def test_a_reply_cut_before_its_length_is_an_error_not_an_empty_object(s3_folder):
    """http.client takes a head cut off at a line end as complete: without Content-Length,
    the body reads as empty. `read` returned b"" for the lease, a manifest or a slice."""
    big, small = os.urandom(3 * PART_MB * MIB), b"a manifest"
    plain = _store(s3_folder.url, s3_folder.options)
    plain.write("obj", big)
    plain.write("small", small)
    with FaultProxy(s3_folder.server.endpoint) as proxy:
        store = _store(s3_folder.url, s3_folder.options, endpoint_url=proxy.endpoint,
                       max_attempts=1)  # fmt: skip
        head = len("HTTP/1.1 206 Partial Content\r\n")  # the status line, then nothing
        for name, call in (("obj", lambda: store.read("obj")),
                           ("obj", lambda: store.read("obj", 6 * MIB, 7 * MIB)),
                           ("small", lambda: store.read("small"))):  # fmt: skip
            proxy.cut_reply(rf"/{name}$", "GET", head)
            with pytest.raises(StorageError, match=rf"ckpt/{name}: read failed: a reply without"):
                call()
        assert bytes(store.read("small")) == small and bytes(store.read("obj")) == big


def test_an_object_replaced_between_its_parts_is_refused(s3, monkeypatch):
    """`read` without a record asks for the later parts on the condition that the object is
    the one the first part came from (If-Match its ETag): never a mix of two versions."""
    old, new = os.urandom(3 * PART_MB * MIB), os.urandom(3 * PART_MB * MIB)
    s3.write("obj", old)
    real_get = type(s3)._get

    def first_then_replace(self, path, a, b):
        got = real_get(self, path, a, b)
        s3.write("obj", new)  # after the first part, before the others
        return got

    monkeypatch.setattr(type(s3), "_get", first_then_replace)
    with pytest.raises(CheckpointCorruptError, match="ckpt/obj: object changed while read"):
        s3.read("obj")
    monkeypatch.undo()
    assert bytes(s3.read("obj")) == new


def _read_in_child(url: str, options: dict, rec: FileRecord, out) -> None:
    store = _store(url, options)
    out.put(bytes(store.read_verified("obj", rec)) == bytes(store.read("obj")))


def test_a_forked_child_reads_with_its_own_pool(s3_folder):
    """A child forked after the parent read inherits the pool without its threads: it makes
    its own (a read waited forever)."""
    import multiprocessing

    store = _store(s3_folder.url, s3_folder.options)
    rec = store.write("obj", os.urandom(3 * PART_MB * MIB))
    store.read_verified("obj", rec)  # the parent's pool and client exist
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(s3_folder.url, s3_folder.options, rec, out))
    child.start()
    try:
        assert out.get(timeout=120) is True  # a bound for a hang, never a speed
    finally:
        child.join(timeout=120)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
