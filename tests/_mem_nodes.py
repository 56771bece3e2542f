"""Real memory `Holder` objects with their real listeners in this process, one per simulated
node, behind a minimal stand-in for Ray (`cluster.install`): the placement, the streams, the
refusals and the reads are the product's own (test_memory_stale_copies, test_memory_fence)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Generator, Iterator
from typing import Any

from forge_ckpt.memory import calls as holder_calls
from forge_ckpt.memory import cluster, transport
from forge_ckpt.memory.holder import Holder
from forge_ckpt.memory.placement import holder_name
from forge_ckpt.memory.transport import Server
from forge_ckpt.storage import FileRecord, StorageSpec, open_storage

NODES = ("A", "B", "C")
PATH = "step-5/trainer/__0_0.distcp"


class _Done:
    """A call's outcome, as a Ray object ref would carry it (awaitable, as a ref is)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        try:
            self.value, self.error = fn(), None
        except Exception as e:  # raised by `get`, as Ray raises a task's error
            self.value, self.error = None, e

    def __await__(self) -> Generator[None, None, Any]:
        if self.error is not None:
            raise self.error
        return self.value
        yield  # a generator: what `await` needs


class _Method:
    def __init__(self, obj: Any, name: str) -> None:
        self.obj, self.name = obj, name

    def remote(self, *args: Any) -> _Done:
        return _Done(lambda: getattr(self.obj, self.name)(*args))


def check_arguments_at_submission(monkeypatch: Any) -> None:
    """Make a holder call check its arguments when it is submitted, as Ray does (a missing
    method: AttributeError; arguments that do not bind: TypeError), not when it runs."""
    real = _Method.remote

    def ray_like(self: _Method, *args: Any) -> _Done:
        inspect.signature(getattr(self.obj, self.name)).bind(*args)
        return real(self, *args)

    monkeypatch.setattr(_Method, "remote", ray_like)


class _Handle:
    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.obj, name)


class Nodes(cluster.RayCluster):
    """Three nodes in this process; `me` is the node the caller runs on."""

    def __init__(self) -> None:
        super().__init__()
        self.me, self.holders = NODES[0], {}

    def ready(self) -> bool:
        return True

    def nodes(self) -> list[str]:
        return list(NODES)

    def node_id(self) -> str:
        return self.me

    def actor(self, name: str, namespace: str) -> _Handle:
        if name not in self.holders:
            raise ValueError(name)
        return _Handle(self.holders[name])

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        if not isinstance(ref, _Done):  # an object `put` stored: the object itself
            return ref
        if ref.error is not None:
            raise ref.error
        return ref.value

    def put(self, obj: Any) -> Any:
        return obj


@contextlib.contextmanager
def three_nodes() -> Iterator[tuple[Nodes, Any, dict[str, Holder]]]:
    """(the nodes, an unfenced store over their holders, the holders by node)."""
    nodes = Nodes()
    old = cluster.install(nodes)
    servers, refs, by_node = [], [], {}
    try:
        for n in NODES:
            nodes.me = n
            h = Holder("run", "fp", budget=1 << 26, keep=4, listen=False)
            h._server = Server("127.0.0.1", h)
            servers.append(h._server)
            name = holder_name("run", n)
            nodes.holders[name] = by_node[n] = h
            refs.append((name, n))
        spec = StorageSpec("mem://run", {"holders": tuple(refs), "copies": 2})
        store = open_storage(spec)
        yield nodes, store, by_node
    finally:
        for s in servers:
            s.stop()
            transport._POOL.drop(s.endpoint)  # this process's idle connections to it
        for name, _ in refs:  # the next test's holders of these names listen elsewhere
            holder_calls.forget(store.namespace, name)
        cluster.install(old)


def fenced(store: Any, claim: int | tuple[int, int], attempt: int) -> Any:
    """The same holders, written by save `attempt` of the opening of the folder `claim`
    ((order, nonce); a number n stands for (n, n))."""
    order, nonce = claim if isinstance(claim, tuple) else (claim, claim)
    options = {**store.spec.options, "fence": (order, nonce, attempt)}
    return open_storage(StorageSpec(store.spec.url, options))


def put(nodes: Nodes, store: Any, node: str, data: bytes, path: str = PATH) -> FileRecord:
    """A trainer rank on `node` writes the step's file (create-only, as every step file)."""
    nodes.me = node
    with store.writer(path, exclusive=True) as w:
        w.write(data)
        return w.close()
