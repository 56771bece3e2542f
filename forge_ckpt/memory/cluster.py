"""The memory tier's one seam to Ray: naming, starting, calling and killing holder actors,
which nodes are alive and which node this process is on, running a few blocking calls at
once, and the clock the tier paces itself by.

Everything else in `forge_ckpt/memory` (placement, copies, retention, persisting, the load
choice) is plain logic over this seam. A job uses `RayCluster`; the deterministic
simulation (`forge_ckpt/sim/memory.py`) installs its own, whose holders are the same
`Holder` objects on simulated nodes, called through the simulation's loop so that a call can
be delayed, lose its reply, or meet a holder that died. Only the data plane's TCP streams
(`transport.py`) stay outside the seam: a holder without a listener is used through Ray.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import ray


class RayCluster:
    """The seam as a real job has it: Ray's actor API, and a thread pool for streams."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def ready(self) -> bool:
        return bool(ray.is_initialized())

    def nodes(self) -> list[str]:
        """The ids of the nodes alive now."""
        return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]

    def node_id(self) -> str:
        """The node of the calling process."""
        return str(ray.get_runtime_context().get_node_id())

    def actor(self, name: str, namespace: str) -> Any:
        """The named actor's handle; ValueError if there is none."""
        return ray.get_actor(name, namespace=namespace)

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        """Wait for a call's result (`handle.method.remote(...)`); a dead actor raises
        RayActorError, a call not answered within `timeout` GetTimeoutError."""
        return ray.get(ref, timeout=timeout)

    def put(self, obj: Any) -> Any:
        return ray.put(obj)

    def kill(self, handle: Any) -> None:
        ray.kill(handle, no_restart=True)

    def start_holder(self, name: str, namespace: str, node: str, *args: Any) -> None:
        """A detached holder actor pinned to `node` (`Holder(*args)` in its own process)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from .holder import HolderActor

        HolderActor.options(
            name=name,
            namespace=namespace,
            lifetime="detached",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(*args)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` beside the caller (streams to or from several holders at once)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(16, thread_name_prefix="forge-mem")
            pool = self._pool
        return pool.submit(fn, *args)

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


_current: RayCluster = RayCluster()


def current() -> RayCluster:
    """The seam the memory tier uses in this process (a `RayCluster` unless the simulation
    installed its own)."""
    return _current


def install(cluster: RayCluster) -> RayCluster:
    """Use `cluster` from now on (the simulation); returns the one it replaces."""
    global _current
    old, _current = _current, cluster
    return old
