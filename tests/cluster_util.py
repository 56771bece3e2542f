"""A 3-node Ray cluster on this machine for the multi-node tests (`tests/test_cluster.py`).

`ray.cluster_utils.Cluster` starts a head and two workers, each with its own raylet and object
store. Each node has a custom resource naming it ({"head": 1}, {"node_a": 1}, {"node_b": 1}) so
that a test pins an actor with `options(resources={"node_a": 0.01})`, and its own private
scratch folder (`NODE_SCRATCH` in the raylet's environment, inherited by its workers). No folder
is shared: checkpoints go to the test S3 server, whose `AWS_*` settings every node gets, as a
real cluster would set them on every machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _trainer_model

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from forge_ckpt import Checkpointable, CheckpointConfig, CheckpointCoordinator, spawn_trainer_ranks  # noqa: E402

WORKERS = ("node_a", "node_b")
# Fast node-death detection: a removed raylet says goodbye, a crashed one is found by these.
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
# The bound of every wait here and of the memory tests' calls: one that only a hang reaches.
# On a busy machine (`make test-under-load`) a fresh actor's first answer took over 60 s.
HANG_S = 300.0
NODE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "OMP_NUM_THREADS": "1"}


@dataclass
class Nodes:
    """The cluster and its worker nodes by name (a removed worker is absent until re-added)."""

    cluster: Cluster
    scratch: str
    env: dict[str, str]
    workers: dict[str, Any] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def add(self, name: str) -> None:
        """Start worker `name` (again): a new raylet with the same resource and scratch;
        returns once Ray lists it alive."""
        scratch = os.path.join(self.scratch, name)
        os.makedirs(scratch, exist_ok=True)
        self.workers[name] = self.cluster.add_node(
            num_cpus=1,
            resources={name: 1},
            object_store_memory=80 * 1024**2,
            env_vars={**self.env, "NODE_SCRATCH": scratch},
        )
        wait_node(self.workers[name].node_id, alive=True)

    def remove(self, name: str) -> None:
        """Kill node `name`'s raylet and every worker process on it; returns once Ray lists
        it dead (so its actors' calls fail instead of waiting for a health check)."""
        node = self.workers.pop(name)
        self.cluster.remove_node(node)
        wait_node(node.node_id, alive=False)

    def restore(self) -> None:
        """Bring back every worker removed by a test, so the next one finds three nodes. It
        waits by node id: the cluster's own wait counts live nodes, and a removed node not
        yet seen dead plus a new one not yet registered is the same count."""
        for name in WORKERS:
            if name not in self.workers:
                self.add(name)
        self.cluster.wait_for_nodes()


def wait_node(node_id: str, alive: bool, timeout: float = HANG_S) -> None:
    """Until Ray's node table lists `node_id` alive (or not alive: dead or gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ray.is_initialized():
            states = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
            if states.get(node_id, False) == alive:
                return
        else:  # not connected yet (the module's cluster is being started)
            return
        time.sleep(0.05)
    raise TimeoutError(f"node {node_id[:8]} is not {'alive' if alive else 'dead'} after {timeout}s")


def memory_config(folder: str, options: dict, **kw: Any) -> CheckpointConfig:
    """The memory tests' config: every save to memory, 2 copies, bounded waits."""
    kw = {"memory_every": 1, "durable_every": 2, "memory_copies": 2, **kw}
    cfg = CheckpointConfig(folder=folder, storage_options=options, **kw)
    cfg.save_timeout_s = cfg.load_timeout_s = cfg.abort_timeout_s = HANG_S
    return cfg


def hold_persist(holder: Any, gate: str, step: int) -> None:
    """Make a memory holder actor hold every persist of `step` until the file `gate`/open
    exists (it raises OSError instead if `gate`/fail exists). On reaching the hold it writes
    its node id to `gate`/entered.<node id>. A condition the test controls: a held persist
    never ends by itself. (All nodes of the test cluster share this machine's disk.)"""

    def install(h: Any) -> None:
        real = type(h).open_durable.__get__(h)

        def gated(spec: Any) -> Any:
            if spec.url.endswith(f"/step-{step}"):
                with open(os.path.join(gate, f"entered.{h.node_id}"), "w") as f:
                    f.write(h.node_id)
                while not os.path.exists(os.path.join(gate, "open")):
                    if os.path.exists(os.path.join(gate, "fail")):
                        raise OSError(f"persist of step {step} failed (the test's gate)")
                    time.sleep(0.01)
            return real(spec)

        h.open_durable = gated

    ray.get(holder.__ray_call__.remote(install), timeout=HANG_S)


def entered(gate: str, timeout: float = HANG_S) -> list[str]:
    """The node ids of the holders held at `gate` (waits for the first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [f.split(".", 1)[1] for f in os.listdir(gate) if f.startswith("entered.")]
        if found:
            return found
        time.sleep(0.02)
    raise TimeoutError(f"no persist reached the gate {gate} in {timeout}s")


def start_cluster(scratch: str, env: dict[str, str]) -> Nodes:
    """Head (the pytest driver's node) + node_a + node_b, all on 127.0.0.1."""
    env = {**NODE_ENV, **env}
    os.makedirs(os.path.join(scratch, "head"), exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"head": 1},
            "object_store_memory": 100 * 1024**2,
            "include_dashboard": False,
            "env_vars": {**env, "NODE_SCRATCH": os.path.join(scratch, "head")},
            "_system_config": SYSTEM_CONFIG,
        },
    )
    nodes = Nodes(cluster, scratch, env)
    for name in WORKERS:
        nodes.add(name)
    cluster.wait_for_nodes()
    return nodes


def connect(nodes: Nodes) -> None:
    """Make this process a driver of the cluster (its actors' owner)."""
    ray.init(
        address=nodes.address,
        log_to_driver=True,
        logging_level="WARNING",
        runtime_env={"env_vars": NODE_ENV},
    )


def driving_cluster(s3_server: Any, tmp_path_factory: Any) -> Iterator[Nodes]:
    """A test module's cluster, this process its driver; every node gets the S3 server's
    AWS_* env. Wrapped as a module-scoped fixture by each module that uses it."""
    nodes = start_cluster(str(tmp_path_factory.mktemp("nodes")), s3_server.env())
    connect(nodes)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield nodes
    ray.shutdown()
    nodes.cluster.shutdown()


def busiest_worker(nodes: Nodes) -> str | None:
    """The worker node holding the most live actors of other drivers (e.g. a GRPO job)."""
    names = {n.node_id: name for name, n in nodes.workers.items()}
    me = ray.get_runtime_context().get_job_id()
    table = ray._private.state.actors().values()  # the GCS actor table (no dashboard needed)
    found = [names.get(a["Address"]["NodeID"]) for a in table if a["State"] == "ALIVE"
             and a["JobID"] != me]  # fmt: skip
    counts = Counter(n for n in found if n is not None)
    return counts.most_common(1)[0][0] if counts else None


def worker_of(nodes: Nodes, class_name: str) -> str | None:
    """A worker node holding a live actor of class `class_name` of another driver."""
    names = {n.node_id: name for name, n in nodes.workers.items()}
    me = ray.get_runtime_context().get_job_id()
    table = ray._private.state.actors().values()
    found = sorted(names[a["Address"]["NodeID"]] for a in table if a["State"] == "ALIVE"
                   and a["JobID"] != me and a["ActorClassName"].endswith(class_name)
                   and a["Address"]["NodeID"] in names)  # fmt: skip
    return found[0] if found else None


def on(node: str) -> dict[str, Any]:
    """Actor options that pin it to `node` (a sliver of that node's own resource)."""
    return {"num_cpus": 0, "resources": {node: 0.01}}


def node_of(actor: Any) -> str:
    """Which node an actor runs on, by the scratch folder its node gave it."""
    return os.path.basename(
        ray.get(actor.__ray_call__.remote(lambda self: os.environ["NODE_SCRATCH"]))
    )


@ray.remote(num_cpus=0)
class Buffer(Checkpointable):
    """A small stateful actor: draws from its own generator and keeps what it drew."""

    def __init__(self, seed: int, hold: str | None = None) -> None:
        self.rng = np.random.default_rng(seed)
        self.history: list[float] = []
        self.hold = hold  # while this file exists, a snapshot waits (a save held in flight)

    def rng_generators(self) -> dict[str, Any]:
        return {"rng": self.rng}

    def step(self) -> float:
        self.history.append(float(self.rng.random()))
        return self.history[-1]

    def slow(self, seconds: float) -> None:
        time.sleep(seconds)

    def state_dict(self) -> dict[str, Any]:
        while self.hold is not None and os.path.exists(self.hold):
            time.sleep(0.01)  # a condition the test controls, never a duration
        return {"history": list(self.history), "blob": np.arange(50_000, dtype=np.float32)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = list(state["history"])


class Placed:
    """An actor class whose n-th `.remote()` goes to the n-th node: `spawn_trainer_ranks` then
    puts rank r on nodes[r]."""

    def __init__(self, actor_cls: Any, nodes: list[str], **options: Any) -> None:
        self.actor_cls, self.nodes, self.options = actor_cls, iter(nodes), options

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        opts = {**on(next(self.nodes)), **self.options}
        return self.actor_cls.options(**opts).remote(*args, **kwargs)


def trainer_ranks(nodes: list[str], seed: int, **options: Any) -> list:
    """One rank of tests/_trainer_model.TrainerRank per node (FSDP2 over gloo when > 1)."""
    import _trainer_model

    ray.cloudpickle.register_pickle_by_value(_trainer_model)
    rank_cls = ray.remote(_trainer_model.TrainerRank)
    ranks = spawn_trainer_ranks(Placed(rank_cls, nodes, **options), len(nodes))
    ray.get([r.setup.remote(seed) for r in ranks])
    return ranks


async def drive(address: str, folder: str, options: dict, out: str, phase: str) -> None:
    """The driver of `test_driver_sigkill_resumes_bitwise`, a process of its own.

    "first": trainer ranks on node_a and node_b, actors on the head and node_b; 2 steps, save
    2, 2 more steps (written to `out`: what a resume must reproduce), then a save of step 4
    whose node_b actor's snapshot waits while `out`.hold exists (created here: the save stays
    in flight, whatever the machine's speed, until the test SIGKILLs us).
    "resume": fresh actors with other seeds, load the newest step, the same 2 steps, to `out`.
    """
    ray.init(address=address, logging_level="WARNING", runtime_env={"env_vars": NODE_ENV})
    seed = 0 if phase == "first" else 7
    hold = out + ".hold" if phase == "first" else None
    ranks = trainer_ranks(["node_a", "node_b"], seed)
    actors = [
        Buffer.options(**on("head")).remote(seed),
        Buffer.options(**on("node_b")).remote(seed + 1, hold),
    ]
    config = CheckpointConfig(folder=folder, storage_options=options)
    config.save_timeout_s = config.load_timeout_s = HANG_S  # the held snapshot: no timeout
    coord = CheckpointCoordinator(config)
    coord.set_trainer(ranks)
    coord.register("dataset", actors[0])
    coord.register("replay", actors[1])

    async def steps(n: int) -> list:
        done = []
        for _ in range(n):
            losses = await asyncio.gather(*(r.train.remote(1) for r in ranks))
            done.append([losses, await asyncio.gather(*(a.step.remote() for a in actors))])
        return done

    if phase == "first":
        await steps(2)
        await coord.save(2)
    else:
        assert (await coord.load()).step == 2
    result = {"steps": await steps(2), "nodes": [node_of(h) for h in [*ranks, *actors]]}
    with open(out, "w") as f:
        json.dump(result, f)
    if phase == "first":
        assert hold is not None
        open(hold, "w").close()  # noqa: SIM115
        print("SAVING", flush=True)
        await coord.save(4)
        print("SAVED", flush=True)  # the test kills us before this
    coord.close()


if __name__ == "__main__":
    address, folder, out, phase = sys.argv[1:5]
    asyncio.run(drive(address, folder, json.loads(os.environ["S3_OPTIONS"]), out, phase))
