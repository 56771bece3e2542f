"""What `python -m benchmarks.tiers` runs against: a real 3-node Ray cluster on loopback
(`ray.cluster_utils.Cluster`: a head and two workers, each its own raylet and object store)
and a real SeaweedFS S3 server, both started here and stopped on the way out, even on error.

Each node has a custom resource naming it ({"head": 1}, {"node_a": 1}, {"node_b": 1}) so that
an actor is pinned with `on("node_a")`, and an object store sized for the state under test
(the memory tier moves each file through the writer's and each holder's store). The benchmark
does not import the tests' cluster helper: these few lines are its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from apps.seaweed import SeaweedServer  # noqa: E402

log = logging.getLogger("benchmarks")

WORKERS = ("node_a", "node_b")
BUCKET = "forge-bench-tiers"
# Node death found in ~2 s (a removed raylet is SIGKILLed; the GCS notices by health checks).
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
NODE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "OMP_NUM_THREADS": "1"}
STORE_FACTOR = 2.5  # object store per node, in units of the state under test
MIN_STORE = 256 * 1024**2


@dataclass
class Env:
    """The cluster, the S3 server and the scratch folder; workers by name (a removed worker
    is absent until `restore()`)."""

    cluster: Cluster
    server: SeaweedServer
    root: str  # scratch folder on the disk under test
    cache: str  # how reads are made cold: 'drop_caches' or 'fadvise'
    store_bytes: int
    workers: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str) -> None:
        """Start worker `name` (again): a new raylet with the same resource and store size."""
        self.workers[name] = self.cluster.add_node(
            num_cpus=1,
            resources={name: 1},
            object_store_memory=self.store_bytes,
            env_vars=dict(NODE_ENV),
        )

    def remove(self, name: str) -> None:
        """Kill node `name`: its raylet, object store and every worker process, no goodbye."""
        self.cluster.remove_node(self.workers.pop(name), allow_graceful=False)

    def restore(self) -> None:
        """Bring back every removed worker, so the next measurement finds three nodes."""
        for name in WORKERS:
            if name not in self.workers:
                self.add(name)
        self.cluster.wait_for_nodes()

    def s3_url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"

    def s3_options(self) -> dict[str, str]:
        """boto3 client options for the server (the same the tests give a CheckpointConfig)."""
        return self.server.storage_options()

    @property
    def s3_data(self) -> str:
        """The server's data folder: evicted from the page cache before an S3 load."""
        return str(self.server.workdir / "data")


def on(node: str) -> dict[str, Any]:
    """Actor options that pin it to `node` (a sliver of that node's own resource)."""
    return {"num_cpus": 0, "resources": {node: 0.01}}


def spawn(cls: type, node: str) -> Any:
    """An actor of `cls` (a plain class: made remote here) pinned to `node`."""
    remote: Any = ray.remote(cls)
    return remote.options(**on(node)).remote()


def _start_cluster(store_bytes: int) -> Cluster:
    return Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"head": 1},
            "object_store_memory": store_bytes,
            "include_dashboard": False,
            "env_vars": dict(NODE_ENV),
            "_system_config": SYSTEM_CONFIG,
        },
    )


@contextlib.contextmanager
def environment(root: str, state_bytes: int, cache: str) -> Iterator[Env]:
    """SeaweedFS + the 3-node cluster, this process its driver; everything stopped at exit."""
    server = SeaweedServer(os.path.join(root, "seaweed"))
    cluster: Cluster | None = None
    try:
        server.start()
        server.create_bucket(BUCKET)
        store = max(int(STORE_FACTOR * state_bytes), MIN_STORE)
        cluster = _start_cluster(store)
        env = Env(cluster, server, root, cache, store)
        env.restore()
        ray.init(
            address=cluster.address,
            logging_level=logging.WARNING,
            log_to_driver=False,  # worker and raylet chatter (a killed node is expected)
            runtime_env={"env_vars": NODE_ENV},
        )
        log.info("cluster up: 3 nodes, %.1f GiB object store each; S3 at %s",
                 store / 1024**3, server.endpoint)  # fmt: skip
        yield env
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        server.stop()
