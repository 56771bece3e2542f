"""Shared fixtures: one local Ray instance per test module, all traffic on loopback."""

from __future__ import annotations

import os

# Must be set before Ray starts: keeps the local instance (and ray.cluster_utils.Cluster) on
# 127.0.0.1 instead of the machine's network interface.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

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
