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
