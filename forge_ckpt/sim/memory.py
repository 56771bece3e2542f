"""The memory tier in the simulation: the real `Holder` objects, one per simulated node, behind
the memory tier's seam to Ray (`forge_ckpt/memory/cluster.py`), so that the tier's placement,
persisting, retention and load choice run unchanged.

A holder is an actor in a process of its own on its node. Its calls run concurrently (a real
holder is a threaded actor), each as a SimThread of that process, after a request latency
and before a reply latency drawn from the seed: a call may be answered later than the
caller's timeout (it still applies), a reply is lost when the holder's node dies after the
call applied (the caller gets ActorDiedError), and a persist in progress stops at its next
storage operation when its node dies. Nodes die (their holder and every actor on them) and
new nodes join, at moments the scenario draws.

`MemoryOracle` reads the holders without faults: which memory steps are committed and whole
now, for the load invariant across both tiers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from collections.abc import Callable, Generator
from concurrent.futures import Future
from typing import Any

import ray

from ..errors import CheckpointCorruptError
from ..memory import calls as holder_calls
from ..memory import cluster as seam
from ..memory import store as memstore
from ..memory.cluster import RayCluster
from ..memory.holder import Holder, step_of
from ..steps import layout
from ..storage import StorageSpec
from ..storage.base import crc32c_of_bytes
from .invariants import Oracle, Violation
from .loop import PROC, Crash, SimThread
from .world import Proc, World

CALL_S = (0.0002, 0.002)  # a holder call's latency each way, in virtual seconds
SLOW_S = (61.0, 90.0)  # a slow answer: past the holder calls' 60 s timeout
HEAD = "node0000head"
DELETES = ("delete", "delete_prefix", "drop_step")
# The share of schedules whose jobs run with the memory tier (a generator of its own decides,
# so that the other schedules, and their seeds' traces, stay as they were).
SHARE = float(os.environ.get("FORGE_SIM_MEMORY", "0.25"))


def _died(name: str) -> ray.exceptions.ActorDiedError:
    e = ray.exceptions.ActorDiedError()
    e.args = (f"holder {name} died (simulated)",)
    return e


class SimCall:
    """`holder.method.remote(*args)`: started when first waited for (`get` or `await`)."""

    def __init__(self, holder: SimHolder, method: str, args: tuple) -> None:
        self.holder, self.method, self.args = holder, method, args
        self.fut: asyncio.Future | None = None
        self.caller = _caller()  # the process that sent it
        holder.cluster.intent(self)

    def start(self) -> asyncio.Future:
        if self.fut is None:
            self.fut = self.holder.cluster.run_call(self)
        return self.fut

    def __await__(self) -> Generator[Any, None, Any]:
        return self.start().__await__()


class _Method:
    def __init__(self, holder: SimHolder, name: str) -> None:
        self._holder, self._name = holder, name

    def remote(self, *args: Any) -> SimCall:
        return SimCall(self._holder, self._name, args)


class SimHolder:
    """The handle of one holder actor: the real Holder, its process and its node."""

    def __init__(self, cluster: SimCluster, name: str, node: str, obj: Holder) -> None:
        self.cluster, self.name, self.node, self.obj = cluster, name, node, obj
        self.proc = Proc(f"holder.{node[-4:]}")

    def __getattr__(self, method: str) -> _Method:
        if method.startswith("_"):
            raise AttributeError(method)
        getattr(self.obj, method)  # AttributeError for what a holder does not have
        return _Method(self, method)


class SimCluster(RayCluster):
    """The seam as the simulation has it: nodes, named holders, calls through the loop."""

    def __init__(self, world: World, rng: random.Random, nodes: int) -> None:
        super().__init__()
        self.world, self.rng = world, rng
        self.alive: list[str] = [HEAD] + [f"node{i:04d}" for i in range(1, nodes)]
        self.dead: list[str] = []
        self.joined = 0
        self.actors: dict[tuple[str, str], SimHolder] = {}
        self.node_of: dict[str, str] = {}  # process name -> its node
        self.slow = rng.uniform(0.0, 0.02) if rng.random() < 0.3 else 0.0
        self.quiet = False  # the oracle reads: inline, without faults
        self.late = 0  # calls answered after their caller's timeout, so far
        self.waiting: set[tuple[str, int]] = set()  # (driver, step) pinned, not yet unpinned
        self._building: str | None = None  # the node of the holder being constructed

    # ---- the seam ---------------------------------------------------------------------------
    def ready(self) -> bool:
        return True

    def nodes(self) -> list[str]:
        return list(self.alive)

    def node_id(self) -> str:
        if self._building is not None:
            return self._building
        th = SimThread.current()
        proc = th.proc if th is not None else PROC.get(None)
        return HEAD if proc is None else self.place(proc.name)

    def place(self, proc: str) -> str:
        """A process's node: a driver on the head node, an actor on a worker node."""
        if proc not in self.node_of:
            workers = [n for n in self.alive if n != HEAD] or [HEAD]
            self.node_of[proc] = (
                HEAD if "." not in proc else workers[len(self.node_of) % len(workers)]
            )
        return self.node_of[proc]

    def actor(self, name: str, namespace: str) -> Any:
        h = self.actors.get((namespace, name))
        if h is None or not h.proc.alive:
            raise ValueError(f"Failed to look up actor with name '{name}' (simulated)")
        return h

    def start_holder(self, name: str, namespace: str, node: str, *args: Any) -> None:
        self._building = node
        try:
            obj = Holder(*args, listen=False)  # type: ignore[misc]
        finally:
            self._building = None
        h = SimHolder(self, name, node, obj)
        self.actors[(namespace, name)] = h
        self.node_of[h.proc.name] = node
        if node not in self.alive:  # its node died since it was listed
            h.proc.alive = False

    def kill(self, handle: Any) -> None:
        self.world.kill(handle.proc)
        self.actors = {k: v for k, v in self.actors.items() if v is not handle}

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        if not isinstance(ref, SimCall):
            return ref  # a small file's bytes, or a put object
        th = SimThread.current()
        if th is None or self.quiet:
            return self._inline(ref)
        if not th.proc.alive:
            raise Crash(th.proc.name)
        fut = ref.start()
        if not th.wait_until(self.world.loop, fut, timeout):
            self.late += 1
            raise ray.exceptions.GetTimeoutError(f"{ref.method} on {ref.holder.name}: no answer")
        return fut.result()

    def put(self, obj: Any) -> Any:
        return obj

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """In turn, not beside: one simulated thread runs at a time anyway."""
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as e:
            fut.set_exception(e)
        return fut

    def monotonic(self) -> float:
        return self.world.clock.now

    def sleep(self, seconds: float) -> None:
        th = SimThread.current()
        if th is not None:
            th.pause(self.world.loop, seconds)

    # ---- calls ------------------------------------------------------------------------------
    def _inline(self, call: SimCall) -> Any:
        if not call.holder.proc.alive:
            raise _died(call.holder.name)
        return self._apply(call)

    def _apply(self, call: SimCall) -> Any:
        result = getattr(call.holder.obj, call.method)(*call.args)
        self._watch(call)
        return result

    def _watch(self, call: SimCall) -> None:
        """A job's own memory retention must not drop a step its own persist waits for (the
        tier pinned it and has not unpinned it yet): failure 4. Dropped: no live holder
        keeps its marker once this removal applied."""
        driver = call.caller
        who = "-" if driver is None else driver.name
        if call.method not in DELETES or self.quiet:
            return
        arg = call.args[0]
        step = arg if isinstance(arg, int) else step_of(str(arg))
        if step is None or (who, step) not in self.waiting or driver is None or not driver.alive:
            return
        marker = f"step-{step}/{layout.MARKER}"
        run = call.holder.obj.run_id
        live = [h.obj for h in self.actors.values() if h.proc.alive and h.obj.run_id == run]
        if not any(marker in h.files for h in live):
            v = Violation("I1 no loss", f"memory step {step} was removed while it waited to "
                          f"be persisted ({who}'s {call.method} on {call.holder.name[-8:]})")  # fmt: skip
            self.world.violation = self.world.violation or v
            raise v

    def run_call(self, call: SimCall) -> asyncio.Future:
        """The call's request reaches the holder after a latency (or much later), runs as a
        thread of the holder's process, and its reply comes back unless the node died."""
        loop, h = self.world.loop, call.holder
        fut = loop.create_future()
        # A removal applied more than its timeout after it was sent is outside the fault
        # model, as in the folder's (world.py): nothing a client does can fence it.
        slow = self.rng.random() < self.slow and call.method not in DELETES
        there = self.rng.uniform(*(SLOW_S if slow else CALL_S))
        back = self.rng.uniform(*CALL_S)
        if slow:
            self.world.log(f"{'-':10} {call.method} on {h.name[-8:]} answered late")

        def body() -> Any:
            try:
                return self._apply(call)
            except Crash:
                raise _died(h.name) from None

        def begin() -> None:
            if not h.proc.alive:
                _settle(fut, _died(h.name))
                return
            inner = loop.create_future()
            inner.add_done_callback(lambda f: loop.call_later(back, deliver, f))
            SimThread(h.proc, body, (), inner).step()

        def deliver(inner: asyncio.Future) -> None:
            if fut.done():
                return
            if not h.proc.alive:  # applied; the reply is lost with the node
                _settle(fut, _died(h.name))
            elif inner.exception() is not None:
                _settle(fut, inner.exception())  # type: ignore[arg-type]
            else:
                fut.set_result(inner.result())

        loop.call_later(there, begin)
        return fut

    def intent(self, call: SimCall) -> None:
        """A pin is the tier's intent (a step due to be persisted, or its persist ended):
        noted when the call is made, whenever it reaches the holder."""
        if call.method == "pin":
            mark = ("-" if call.caller is None else call.caller.name, int(call.args[0]))
            (self.waiting.add if call.args[1] else self.waiting.discard)(mark)

    # ---- faults -----------------------------------------------------------------------------
    def lose_node(self, node: str | None = None) -> str | None:
        """A worker node dies: its holder and every process on it."""
        workers = [n for n in self.alive if n != HEAD]
        if node is None:
            if not workers:
                return None
            node = self.rng.choice(workers)
        self.alive.remove(node)
        self.dead.append(node)
        self.world.log(f"NODE LOST {node}")
        for h in [h for h in self.actors.values() if h.node == node]:
            self.world.kill(h.proc)
        self.actors = {k: v for k, v in self.actors.items() if v.node != node}
        return node

    def on_node(self, node: str) -> list[str]:
        return [p for p, n in self.node_of.items() if n == node]

    def join_node(self) -> str:
        self.joined += 1
        node = f"nodej{self.joined:03d}"
        self.alive.append(node)
        self.world.log(f"NODE JOINED {node}")
        return node


def _caller() -> Proc | None:
    th = SimThread.current()
    return th.proc if th is not None else PROC.get(None)


def _settle(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)


def hermetic() -> None:
    """A schedule starts with Ray's seam and no cached holder handles."""
    seam.install(RayCluster())
    with holder_calls._lock:
        holder_calls._handles.clear()
        holder_calls._endpoints.clear()
        holder_calls._warned.clear()


class MemoryOracle:
    """The memory tier's truth, read from the live holders without faults."""

    def __init__(self, cluster: SimCluster, run_id: str, namespace: str) -> None:
        self.cluster, self.run_id, self.namespace = cluster, run_id, namespace

    def store(self) -> memstore.MemoryStorage:
        refs = tuple((h.name, h.node) for (ns, _), h in sorted(self.cluster.actors.items())
                     if ns == self.namespace and h.proc.alive and self.run_id in h.name)  # fmt: skip
        spec = StorageSpec(f"mem://{self.run_id}", {"holders": refs or (("none", HEAD),),
                                                    "namespace": self.namespace})  # fmt: skip
        return memstore.MemoryStorage(spec)

    def whole(self) -> dict[tuple[int, float], layout.Manifest]:
        """Committed memory steps whose every file some live holder has, intact."""
        return self.steps()[1]

    def steps(
        self,
    ) -> tuple[dict[tuple[int, float], layout.Manifest], dict[tuple[int, float], layout.Manifest]]:
        """(committed memory steps, those of them whole)."""
        self.cluster.quiet = True
        try:
            store = self.store()
            live = [h.obj.files for h in self.cluster.actors.values()
                    if h.proc.alive and self.run_id in h.name]  # fmt: skip
            committed, whole = {}, {}
            for s in layout.committed_steps(store):
                try:
                    m = layout.read_committed(store, s)
                except (CheckpointCorruptError, FileNotFoundError):
                    continue
                committed[(s, m.created)] = m
                name = layout.step_name(s)
                if all(any(_intact(fs.get(f"{name}/{f.path}"), f) for fs in live) for f in m.files):
                    whole[(s, m.created)] = m
            return committed, whole
        finally:
            self.cluster.quiet = False


def _intact(data: bytes | bytearray | None, f: Any) -> bool:
    return data is not None and len(data) == f.size and crc32c_of_bytes(data) == f.crc32c


# ---- the scenario's hooks --------------------------------------------------------------------
def setup(world: World, config: Any) -> Any:
    """Maybe turn this schedule's jobs to the memory tier (every save to memory, every
    `durable_every`-th persisted) on 3 or 4 simulated nodes; the config its jobs use."""
    rng = random.Random(world.seed * 104729 + 17)
    if rng.random() >= SHARE:
        return config
    world.memory = SimCluster(world, rng, nodes=rng.choice([3, 4]))
    seam.install(world.memory)
    return dataclasses.replace(config, memory_every=1, durable_every=rng.choice([1, 2, 3]),
                               memory_keep=rng.choice([1, 2]), memory_copies=2,
                               memory_budget_bytes=1 << 20)  # fmt: skip


def oracle_for(world: World, config: Any) -> MemoryOracle | None:
    from ..memory.tier import run_id_of

    if world.memory is None:
        return None
    return MemoryOracle(world.memory, run_id_of(config.folder), config.memory_namespace)


def faults_for_job(world: World, procs: Callable[[], list[Proc]]) -> None:
    """While a job runs: a worker node may die (its holder and the job's actors on it), a
    second one too, and a new node may join. `procs`: the processes that may be on it."""
    cluster = world.memory
    if cluster is None:
        return
    rng = cluster.rng

    def lose() -> None:
        node = cluster.lose_node()
        if node is None:
            return
        on = set(cluster.on_node(node))
        for p in procs():
            if p.name in on:
                world.kill(p)

    for share in (0.3, 0.1):
        if rng.random() < share:
            world.loop.call_later(rng.uniform(0.0, 0.4), lose)
    if rng.random() < 0.5:
        world.loop.call_later(rng.uniform(0.0, 0.5), cluster.join_node)


def expected_load(oracle: Oracle, mem: MemoryOracle) -> int | None:
    """The newest step of either tier a load may return: a whole memory step or a legit
    durable one, neither abandoned by a committed newer branch of either tier."""
    committed, whole = mem.steps()
    gone = {tuple(p) for m in committed.values() for p in m.supersedes}
    gone |= {tuple(p) for i, m in oracle.manifests().items() for p in m.supersedes
             if i in oracle.loadable()}  # fmt: skip
    steps = [i[0] for i in [*oracle.loadable(), *whole] if i not in gone]
    return max(steps, default=None)


def check_load(
    oracle: Oracle, mem: MemoryOracle, got: int | None, before: int | None, late: int
) -> None:
    """I2 across the tiers; `before`: what was expected when the load began (a node lost
    during the load may have taken the step it chose since). `late`: the count of holder
    calls answered after their timeout when it began; a load that met one counted that
    holder as dead (by design: a timeout is how Ray tells a holder that died), so it is
    not held to what that holder has."""
    if mem.cluster.late != late:
        return
    oracle.refresh()
    now = expected_load(oracle, mem)
    if got not in (now, before):
        raise Violation("I2 load", f"load() returned step {got}, the newest whole step of "
                        f"either tier is {now} (it was {before} when the load began)")  # fmt: skip


def check_failed_load(e: BaseException) -> None:
    """A recovery load never fails on a background persist's failure (failure 5): it logs it
    and loads the newest whole step of either tier."""
    if "persisting" in str(e):
        raise Violation("I2 load", f"load() raised a persist's failure: {str(e)[:200]}")


def check_reported(mem: MemoryOracle, step: int, mine: bool) -> None:
    """A memory save reported committed is whole in memory, unless nodes died meanwhile or
    another job holds the folder now (`mine`: it does not)."""
    if mem.cluster.dead or not mine:
        return
    if step not in {s for s, _ in mem.whole()}:
        raise Violation("I1 no loss", f"memory save({step}) reported committed, not whole")
