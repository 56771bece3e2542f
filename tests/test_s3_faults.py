"""Checkpoints on a real S3 server (SeaweedFS, auth on) when things go wrong: bad credentials,
a missing bucket, the endpoint down before and during a save, throttling, and a second job on
the same folder (the lease, with a stale holder that wakes up after being taken over)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from forge_ckpt import (
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointError,
    CheckpointLockedError,
    CheckpointSaveError,
)

sys.path.insert(0, os.path.dirname(__file__))
from s3proxy import FaultProxy  # noqa: E402
from test_coordinator import build, run_steps  # noqa: E402


def cfg(url: str, options: dict, **kw) -> CheckpointConfig:
    return CheckpointConfig(folder=url, storage_options=options, **kw)


def test_wrong_secret_names_the_problem_not_the_secret(s3_folder):
    options = {**s3_folder.options, "aws_secret_access_key": "not-the-secret-123"}
    with pytest.raises(CheckpointError) as e:
        CheckpointCoordinator(cfg(s3_folder.url, options))
    assert "check the credentials" in str(e.value) and "SignatureDoesNotMatch" in str(e.value)
    assert "not-the-secret-123" not in str(e.value)
    assert s3_folder.options["aws_secret_access_key"] not in str(e.value)


def test_missing_bucket(s3_folder):
    with pytest.raises(CheckpointError, match="the bucket does not exist"):
        CheckpointCoordinator(cfg("s3://no-such-bucket-4242/ckpt", s3_folder.options))


@pytest.fixture
def proxied(s3_folder):
    with FaultProxy(s3_folder.server.endpoint) as proxy:
        options = {
            **s3_folder.options,
            "endpoint_url": proxy.endpoint,
            "max_attempts": 3,
            "connect_timeout_s": 1.0,
            "read_timeout_s": 10.0,
        }
        yield proxy, s3_folder.url, options


HANG_S = 300.0  # a hang's bound, never a speed's


def test_endpoint_down_at_start(proxied):
    proxy, url, options = proxied
    proxy.down()
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match="cannot reach the S3 endpoint"):
        CheckpointCoordinator(cfg(url, options))
    assert time.perf_counter() - t0 < HANG_S  # bounded by retries and timeouts: no hang


async def test_endpoint_down_before_and_during_a_save(ray_local, proxied):
    proxy, url, options = proxied
    coord, samplers, stats = await build(cfg(url, options, async_mode="deferred"))
    await run_steps(samplers, stats, 1)
    await coord.save(1)
    await coord.wait()
    want = [await s.get.remote() for s in samplers]

    await run_steps(samplers, stats, 1)
    proxy.down()  # before the save
    with pytest.raises(CheckpointSaveError, match="cannot reach the S3 endpoint"):
        await coord.save(2)
        await coord.wait()
    proxy.up()
    assert coord.steps() == [1]

    await coord.save(2)  # returns after the snapshot; everything else is still to come
    proxy.down()  # during the save: the writes and the commit cannot reach the endpoint
    with pytest.raises(
        CheckpointSaveError, match="nothing was committed .*none of them was touched"
    ):
        await coord.wait()
    proxy.up()
    assert coord.steps() == [1]
    assert (await coord.load()).step == 1  # the previous step is intact
    got = [await s.get.remote() for s in samplers]
    assert all(g["history"] == w["history"] for g, w in zip(got, want, strict=True))
    assert (await coord.save(2)).step == 2 and (await coord.wait()).committed
    coord.close()


async def test_throttling_and_5xx_are_retried(ray_local, proxied):
    proxy, url, options = proxied
    coord, samplers, stats = await build(cfg(url, {**options, "max_attempts": 6}))
    await run_steps(samplers, stats, 1)
    proxy.fail_next(2, status=503, code="SlowDown")
    assert (await coord.save(1)).committed
    proxy.fail_next(2, status=500, code="InternalError")
    assert (await coord.save(2)).committed
    assert proxy.failed >= 4
    coord.close()


async def test_a_commit_whose_reply_was_lost_is_committed(ray_local, proxied):
    """The server applied the COMMIT PUT and its reply was lost; boto3's retry gets 412 on our
    own marker: that is not another writer, and the step stays (and loads)."""
    proxy, url, options = proxied
    coord, samplers, stats = await build(cfg(url, options))
    await run_steps(samplers, stats, 1)
    want = [await s.get.remote() for s in samplers]
    proxy.drop_reply(r"/step-1/COMMIT$")
    assert (await coord.save(1)).committed
    assert proxy.dropped == 1 and coord.steps() == [1]
    await run_steps(samplers, stats, 1)
    assert (await coord.load()).step == 1
    got = [await s.get.remote() for s in samplers]
    assert all(g["history"] == w["history"] for g, w in zip(got, want, strict=True))
    coord.close()


HOLDER = """
import asyncio, sys
from forge_ckpt import CheckpointConfig, CheckpointCoordinator
url, endpoint, key, secret = sys.argv[1:5]
opts = dict(endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
            region_name="us-east-1")
async def main():
    coord = CheckpointCoordinator(CheckpointConfig(folder=url, storage_options=opts,
                                                   lease_ttl_s=3))
    await coord.save(1)
    print("saved 1", flush=True)
    sys.stdin.readline()
    try:
        await coord.save(3)
        print("committed 3", flush=True)
    except Exception as e:
        print(f"refused {type(e).__name__}: {e}", flush=True)
asyncio.run(main())
"""


def start_holder(s3_folder) -> subprocess.Popen:
    o = s3_folder.options
    args = [s3_folder.url, o["endpoint_url"], o["aws_access_key_id"], o["aws_secret_access_key"]]
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "saved 1"
    return proc


def open_once_expired(config: CheckpointConfig, timeout: float = 120.0) -> CheckpointCoordinator:
    """A coordinator on the folder once the stalled holder's lease has expired (a condition:
    every try before that is refused as locked)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return CheckpointCoordinator(config)
        except CheckpointLockedError:
            assert time.monotonic() < deadline, f"the lease did not expire in {timeout}s"
            time.sleep(0.2)


def test_second_job_is_refused_then_takes_over_and_fences_the_stale_holder(s3_folder):
    first = start_holder(s3_folder)
    try:
        with pytest.raises(CheckpointLockedError, match=f"pid {first.pid}"):
            CheckpointCoordinator(cfg(s3_folder.url, s3_folder.options))
        first.send_signal(signal.SIGSTOP)  # stalls: no renewals, its lease expires
        second = open_once_expired(cfg(s3_folder.url, s3_folder.options))
        assert asyncio.run(second.save(2)).committed
        first.send_signal(signal.SIGCONT)  # wakes up believing it still holds the folder
        first.stdin.write("go\n")
        first.stdin.flush()
        line = first.stdout.readline().strip()
        assert line.startswith("refused CheckpointLockedError") and "lost the lease" in line
        assert second.steps() == [1, 2]  # no step 3 from the stale holder
        second.close()
    finally:
        first.kill()
        first.wait()


def test_killed_holder_is_taken_over(s3_folder):
    first = start_holder(s3_folder)
    first.kill()  # SIGKILL: a dead process on this host does not hold the lease
    first.wait()
    second = CheckpointCoordinator(cfg(s3_folder.url, s3_folder.options))
    assert second.steps() == [1] and asyncio.run(second.save(2)).committed
    second.close()


async def test_cli_takes_s3_urls(ray_local, s3_folder, monkeypatch):
    from typer.testing import CliRunner

    from forge_ckpt.cli import app

    coord, samplers, stats = await build(cfg(s3_folder.url, s3_folder.options))
    await run_steps(samplers, stats, 1)
    await coord.save(1)
    coord.close()
    for k, v in s3_folder.server.env().items():  # the CLI takes the standard AWS environment
        monkeypatch.setenv(k, v)
    runner = CliRunner()
    out = runner.invoke(app, ["list", s3_folder.url])
    assert out.exit_code == 0 and "yes" in out.output, out.output
    out = runner.invoke(app, ["verify", f"{s3_folder.url}/step-1"])
    assert out.exit_code == 0 and "files intact" in out.output, out.output
    out = runner.invoke(app, ["inspect", f"{s3_folder.url}/step-1"])
    assert out.exit_code == 0 and "sampler" in out.output, out.output
    assert runner.invoke(app, ["gc", s3_folder.url]).exit_code == 0
    assert s3_folder.options["aws_secret_access_key"] not in out.output
