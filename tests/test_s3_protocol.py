"""S3Storage against a real SeaweedFS where the protocol relies on it (issue 22, items 6, 7, 15,
16): a folder is a folder (`exp1` never touches `exp10`, `step-1` never `step-10`), a write whose
reply was lost is not another writer's, one request has a bound, and quarantine copies objects
above CopyObject's limit in parts."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import pytest

from forge_ckpt import CheckpointConfig, CheckpointCoordinator
from forge_ckpt.steps.commit import quarantine_step, remove_step
from forge_ckpt.steps.lock import Lease
from forge_ckpt.storage import AlreadyExistsError, StorageError, StorageSpec
from forge_ckpt.storage import s3 as s3mod
from forge_ckpt.storage.s3 import S3Storage

sys.path.insert(0, os.path.dirname(__file__))
from s3proxy import FaultProxy  # noqa: E402
from s3util import S3Folder, client, list_keys  # noqa: E402

MiB = 1024 * 1024


def uploads(s3: Any, bucket: str) -> set[str]:
    """Keys of the unfinished multipart uploads in the bucket, across pages."""
    pages = s3.get_paginator("list_multipart_uploads").paginate(Bucket=bucket)
    return {u["Key"] for page in pages for u in page.get("Uploads", [])}


def start_upload(s3: Any, bucket: str, key: str) -> str:
    """An in-flight multipart upload with one part sent (a save still writing `key`)."""
    upload_id = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    s3.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=b"p" * 1024)
    return str(upload_id)


def storage(url: str, options: dict[str, Any]) -> S3Storage:
    return S3Storage(StorageSpec(url, dict(options)))


def save_empty_step(url: str, options: dict[str, Any], step: int) -> None:
    """Open the folder as a job does (its start-up cleanup runs), commit `step`, close."""
    coord = CheckpointCoordinator(CheckpointConfig(folder=url, storage_options=options))
    try:
        assert asyncio.run(coord.save(step)).committed
    finally:
        coord.close()


# ---- item 6: a prefix is a folder ----------------------------------------------------------


def test_opening_exp1_and_removing_step_1_leave_exp10_and_step_10_uploads(s3_folder: S3Folder):
    s3, bucket = client(s3_folder.options), s3_folder.bucket
    exp1, exp10 = f"s3://{bucket}/runs/exp1", f"s3://{bucket}/runs/exp10"
    start_upload(s3, bucket, "runs/exp10/step-1/actors/a.bin")  # exp10's job is saving
    start_upload(s3, bucket, "runs/exp1/step-4/actors/a.bin")  # a crashed save of exp1's
    save_empty_step(exp1, s3_folder.options, 1)
    assert uploads(s3, bucket) == {"runs/exp10/step-1/actors/a.bin"}

    start_upload(s3, bucket, "runs/exp1/step-10/actors/a.bin")  # exp1's save of step 10
    remove_step(storage(exp1, s3_folder.options), 1)  # retention removes step 1 meanwhile
    assert uploads(s3, bucket) == {
        "runs/exp10/step-1/actors/a.bin",
        "runs/exp1/step-10/actors/a.bin",
    }
    assert storage(exp10, s3_folder.options).abort_uploads("") == 1
    assert uploads(s3, bucket) == {"runs/exp1/step-10/actors/a.bin"}


def test_step_1_operations_leave_step_10_objects(s3_folder: S3Folder):
    store = storage(s3_folder.url, s3_folder.options)
    for name in ("step-1/a", "step-1/b/c", "step-10/a", "step-10/COMMIT", "step-1x"):
        store.write(name, name.encode())
    assert store.list("step-1") == ["a", "b"]
    assert [p for p, _ in store.walk("step-1")] == ["step-1/a", "step-1/b/c"]
    store.move_prefix("step-1", "quarantine/step-1.0", first="step-1/a")
    assert [p for p, _ in store.walk("quarantine")] == [
        "quarantine/step-1.0/a",
        "quarantine/step-1.0/b/c",
    ]
    store.delete_prefix("quarantine/step-1")  # not a folder of its own: nothing goes
    assert store.list("quarantine") == ["step-1.0"]
    assert store.list("") == ["quarantine", "step-10", "step-1x"]


def test_a_folder_at_the_bucket_root_aborts_only_its_own_uploads(s3_folder: S3Folder):
    s3, bucket = client(s3_folder.options), s3_folder.bucket
    start_upload(s3, bucket, "datasets/shard-0.bin")  # another tool's upload in the same bucket
    start_upload(s3, bucket, "runs/exp1/step-2/a.bin")  # a folder below the root
    start_upload(s3, bucket, "step-3/actors/a.bin")  # the root folder's crashed save
    start_upload(s3, bucket, "quarantine/step-1.5/a.bin")  # its interrupted quarantine
    save_empty_step(f"s3://{bucket}", s3_folder.options, 1)
    assert uploads(s3, bucket) == {"datasets/shard-0.bin", "runs/exp1/step-2/a.bin"}


def test_every_page_of_uploads_is_aborted(s3_folder: S3Folder, monkeypatch):
    """SeaweedFS answers every upload in one reply unless asked for less (1,010 checked), so
    the page is made small here: five uploads take three pages and every one is aborted."""
    monkeypatch.setattr(s3mod, "UPLOADS_PAGE", 2, raising=False)
    s3, bucket = client(s3_folder.options), s3_folder.bucket
    for i in range(5):
        start_upload(s3, bucket, f"{s3_folder.prefix}/step-{i}/a.bin")
    start_upload(s3, bucket, f"{s3_folder.prefix}0/step-1/a.bin")  # a sibling folder
    with FaultProxy(s3_folder.server.endpoint) as proxy:
        store = storage(s3_folder.url, {**s3_folder.options, "endpoint_url": proxy.endpoint})
        assert store.abort_uploads("") == 5
        listings = [r for r in proxy.log if r.startswith("GET ") and "uploads" in r]
    assert len(listings) >= 3, listings
    assert uploads(s3, bucket) == {f"{s3_folder.prefix}0/step-1/a.bin"}


# ---- item 7: a write whose reply was lost -------------------------------------------------


@pytest.fixture
def proxied(s3_folder: S3Folder):
    """The folder through a fault proxy; boto3 retries on (3 tries)."""
    with FaultProxy(s3_folder.server.endpoint) as proxy:
        options = {
            **s3_folder.options,
            "endpoint_url": proxy.endpoint,
            "max_attempts": 3,
            "connect_timeout_s": 2.0,
            "read_timeout_s": 10.0,
        }
        yield proxy, storage(s3_folder.url, options)


def test_create_and_replace_whose_reply_was_lost_succeed(proxied):
    proxy, store = proxied
    proxy.drop_reply(r"/ckpt/MARK$")
    tag = store.create("MARK", b"one")
    assert proxy.dropped == 1 and proxy.log.count(f"PUT /{store.bucket}/ckpt/MARK") == 2
    assert store.read_tagged("MARK") == (b"one", tag)
    proxy.drop_reply(r"/ckpt/MARK$")
    tag2 = store.replace("MARK", b"two", tag)
    assert proxy.dropped == 2 and store.read_tagged("MARK") == (b"two", tag2)
    with pytest.raises(AlreadyExistsError):  # another writer's object stays another's
        store.create("MARK", b"three")
    with pytest.raises(StorageError, match="refused"):
        store.replace("MARK", b"three", tag)


def test_a_lease_renewal_whose_reply_was_lost_keeps_the_lease(proxied):
    proxy, store = proxied
    lease = Lease(store, ttl_s=600)  # no renewal from its thread during the test
    lease.acquire()
    try:
        proxy.drop_reply(r"/\.forge_ckpt\.lease$")
        lease.renew()
        assert proxy.dropped == 1 and lease.held
        lease.renew()  # the tag it kept is the server's: the next renewal works too
        assert lease.held
    finally:
        lease.release()


# ---- item 15: one request has a bound -----------------------------------------------------


def test_default_bound_of_one_request_is_under_the_default_lease_ttl():
    bound = s3mod.call_bound_s(s3mod.OPTIONS)
    assert bound < CheckpointConfig(folder="/unused").lease_ttl_s


def test_a_black_hole_endpoint_raises_naming_the_timeout(proxied):
    proxy, store = proxied
    options = {**store.spec.options, "read_timeout_s": 0.5, "max_attempts": 2}
    slow = storage(store.url, options)
    proxy.hang()
    with pytest.raises(StorageError) as e:
        slow.create("MARK", b"one")
    assert "read_timeout_s=0.5" in str(e.value) and "max_attempts=2" in str(e.value)
    proxy.wait_count("hung", 2)  # every try was answered by silence, none by an error
    assert proxy.hung == 2
    proxy.clear()


# ---- item 16: quarantine above CopyObject's limit -----------------------------------------


def test_quarantine_copies_large_objects_in_parts(s3_folder: S3Folder, monkeypatch):
    monkeypatch.setattr(s3mod, "MULTIPART_COPY_THRESHOLD", 6 * MiB, raising=False)
    writer = storage(s3_folder.url, s3_folder.options)  # 32 MiB parts: one PUT per object
    store = storage(s3_folder.url, {**s3_folder.options, "part_size_mb": 5})
    big = os.urandom(12 * MiB + 123)
    files = {"step-1/actors/big.bin": big, "step-1/actors/small.bin": b"s" * 1000}
    files.update({f"step-1/actors/{i}.bin": os.urandom(7 * MiB) for i in range(2)})
    for name, data in files.items():
        writer.write(name, data)
    writer.create("step-1/COMMIT", b"marker")
    s3 = client(s3_folder.options)
    head = s3.head_object(Bucket=s3_folder.bucket, Key=store.key("step-1/actors/big.bin"))
    assert "-" not in head["ETag"]  # written in one piece
    dest = quarantine_step(store, 1)
    assert list_keys(s3, s3_folder.bucket, f"{s3_folder.prefix}/step-1/") == []
    for name, data in {**files, "step-1/COMMIT": b"marker"}.items():
        moved = f"{dest}/{name.removeprefix('step-1/')}"
        assert store.read(moved) == data, moved
    head = s3.head_object(Bucket=s3_folder.bucket, Key=store.key(f"{dest}/actors/big.bin"))
    assert head["ETag"].endswith('-3"')  # 5 + 5 + 2 MiB: copied in three parts
    assert uploads(s3, s3_folder.bucket) == set()


def test_a_failed_quarantine_copy_leaves_the_step_whole_and_nothing_behind(
    s3_folder: S3Folder, monkeypatch
):
    monkeypatch.setattr(s3mod, "MULTIPART_COPY_THRESHOLD", 6 * MiB, raising=False)
    files = {"step-1/actors/big.bin": os.urandom(12 * MiB), "step-1/COMMIT": b"marker"}
    files.update({f"step-1/actors/{i}.bin": os.urandom(1000) for i in range(8)})
    writer = storage(s3_folder.url, s3_folder.options)
    for name, data in files.items():
        writer.write(name, data)
    with FaultProxy(s3_folder.server.endpoint) as proxy:
        options = {**s3_folder.options, "endpoint_url": proxy.endpoint, "part_size_mb": 5}
        store = storage(s3_folder.url, options)
        proxy.fail_matching(r"[?&]partNumber=2(&|$)", "PUT", 1, 400, "InvalidRequest")
        with pytest.raises(StorageError, match=r"big\.bin: write failed"):
            quarantine_step(store, 1)
    for name, data in files.items():
        assert writer.read(name) == data, name
    assert writer.list("") == ["step-1"]  # no half copy in quarantine/
    assert uploads(client(s3_folder.options), s3_folder.bucket) == set()
