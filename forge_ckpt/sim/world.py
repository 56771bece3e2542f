"""One simulated world: processes, their storage, their actors, and the faults that hit them.

Every storage operation of every process passes `World.gate`, which draws from the seeded
generator how long it takes (sometimes longer than the lease TTL), whether it fails before it
applies, whether it applies and its reply is lost (S3: the client's retry then sees its own
write), and, for a process killed meanwhile, whether its request was already on the wire
(it lands after the crash). Both stores are the product's own code: `LocalStorage` on a real
temporary folder and `S3Storage` on the in-memory S3 server.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..steps.layout import LEASE, MANIFEST, MARKER
from ..storage import SCHEMES, StorageSpec
from ..storage.local import LocalStorage
from ..storage.s3 import S3Storage
from .invariants import Changes
from .loop import PROC, Clock, Crash, SimLoop, SimThread
from .s3server import Bucket, Client

_WORLDS: dict[str, World] = {}
LATE_SHARE = 0.05  # schedules whose first job's COMMIT is held past the lease TTL (fix 8)


@dataclass
class Faults:
    """Per-operation probabilities, drawn per seed so that some schedules are fault-heavy."""

    fail: float = 0.0  # fails before it applies (after the client's retries)
    lost: float = 0.0  # applies, the reply is lost (S3 only; a retry follows)
    delay: float = 0.0  # takes longer than the lease TTL
    wire: float = 0.5  # a killed process's request still lands

    @classmethod
    def draw(cls, rng: random.Random, s3: bool) -> Faults:
        heavy = rng.random() < 0.5
        return cls(
            fail=rng.uniform(0, 0.04 if heavy else 0.01),
            lost=rng.uniform(0, 0.08 if heavy else 0.01) if s3 else 0.0,
            delay=rng.uniform(0, 0.05) if rng.random() < 0.4 else 0.0,
        )


@dataclass
class Proc:
    """A simulated OS process (a job's driver or an actor), on its own simulated host."""

    name: str
    alive: bool = True
    tasks: list[asyncio.Task] = field(default_factory=list)
    on_kill: list[Callable[[], None]] = field(default_factory=list)  # what dies with it

    def identity(self) -> dict[str, Any]:
        return {"host": f"sim-{self.name}", "pid": 1, "pid_start": "1"}


class Trace:
    """A schedule's event trace, formatted only when read: a run of many seeds reads the
    trace of none of them, and formatting every event cost more than recording it."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._events: list[tuple] = []  # (virtual time, line) or (virtual time, *an operation)

    def add(self, line: str) -> None:
        self._events.append((self._clock.now, line))

    def op(self, who: str, op: str, path: str, outcome: str, delayed: bool) -> None:
        self._events.append((self._clock.now, who, op, path, outcome, delayed))

    def lines(self) -> list[str]:
        return [f"{e[0]:9.4f} {e[1] if len(e) == 2 else _op_line(*e[1:])}" for e in self._events]


def _op_line(who: str, op: str, path: str, outcome: str, delayed: bool) -> str:
    return f"{who:10} {op} {path} {outcome}{' (delayed)' if delayed else ''}"


class World:
    def __init__(self, seed: int, s3: bool, root: str, ttl: float) -> None:
        self.id = f"w{seed}"  # messages name it: the same seed, the same trace
        self.seed, self.s3, self.ttl = seed, s3, ttl
        self.rng = random.Random(seed)
        self.cancels = random.Random(seed * 7919 + 1)  # the caller's deadlines (scenario.py)
        self.faults = Faults.draw(self.rng, s3)
        # The late-COMMIT family: one of the first job's COMMIT writes is held past the TTL
        # while its successor takes over (scenario.py). Drawn from a generator of its own, so
        # the schedules outside the family stay as they were.
        self.late = random.Random(seed * 104729 + 7)
        self.late_commit = self.late.random() < LATE_SHARE
        self._late_marker = self.late.randint(0, 1)  # which of its COMMIT writes (0: first)
        self.clock = Clock()
        self.loop = SimLoop(self.clock)
        self.handed_over: asyncio.Future = self.loop.create_future()  # a successor opened
        self.root = root
        self.bucket = Bucket()
        self.client = Client(self.bucket, self.gate)
        self.events = Trace(self.clock)
        self.observers: list[Callable[[], None]] = []
        self.observe_next = False
        self.changes = Changes()  # what the oracle reads may have changed (its cache)
        self.violation: AssertionError | None = None  # the first one the oracle found
        self.threads: list[SimThread] = []
        self.memory: Any = None  # the memory tier's simulated cluster, if it runs (memory.py)
        _WORLDS[self.id] = self

    @property
    def folder(self) -> str:
        return f"{'sims3' if self.s3 else 'simfs'}://{self.id}/bkt/runs/exp1"

    @property
    def trace(self) -> list[str]:
        return self.events.lines()

    def log(self, line: str) -> None:
        self.events.add(line)

    def kill(self, proc: Proc) -> None:
        if not proc.alive:
            return
        proc.alive = False
        self.log(f"KILL {proc.name}")
        for fn in proc.on_kill:
            fn()
        for t in proc.tasks:
            t.cancel()

    def _held_late(self, path: str, mutates: bool, proc: Proc | None) -> bool:
        """Whether this is the late-COMMIT family's write to hold past the TTL."""
        if not (self.late_commit and mutates and path.endswith(MARKER)):
            return False
        if proc is None or proc.name != "job0":
            return False
        self._late_marker -= 1
        return self._late_marker == -1

    # ---- the gate ---------------------------------------------------------------------------
    def gate(self, op: str, path: str, mutates: bool) -> str:
        """'ok', 'fail' (nothing applied), 'lost' (applied, reply lost) or 'after' (applied,
        then the process is found dead). Raises Crash for a dead process's new request."""
        if self.observe_next:  # a marker just landed: let the oracle look before anything else
            self.observe_next = False
            try:
                for obs in self.observers:
                    obs()
            except AssertionError as v:  # kept here: the product's code may catch it
                self.violation = self.violation or v
                raise
        th = SimThread.current()
        proc = th.proc if th is not None else PROC.get(None)
        if proc is not None and not proc.alive:
            raise Crash(proc.name)
        f, r = self.faults, self.rng
        # A delete that the server applies more than a TTL after it was sent cannot be
        # fenced by a client (no conditional delete on most S3 endpoints; forge_ckpt bounds
        # each request below the TTL instead, docs/storage.md): not part of the fault model.
        delayed = r.random() < f.delay and "delete" not in op
        latency = self.ttl * r.uniform(1.05, 2.0) if delayed else r.uniform(0.0005, 0.01)
        if th is not None and self._held_late(path, mutates, proc):
            delayed = True  # held until a successor has opened, then lands amid its saves
            th.wait_until(self.loop, self.handed_over, 6 * self.ttl)
            latency = self.late.uniform(0.0, 0.1)
        if th is not None:
            th.pause(self.loop, latency)
        outcome = "ok"
        if proc is not None and not proc.alive:
            if not (mutates and r.random() < f.wire):
                raise Crash(proc.name)
            outcome = "after"
        elif r.random() < f.fail:
            outcome = "fail"
        elif mutates and r.random() < f.lost:
            outcome = "lost"
        self.events.op(proc.name if proc is not None else "-", op, path, outcome, delayed)
        if mutates and outcome != "fail" and _may_commit(op, path):
            self.changes.wrote(path, op in _ONE_PATH)
        if mutates and outcome != "fail" and path.endswith(MARKER):
            self.observe_next = True
        return outcome


_NO_COMMIT = {"makedirs", "create_multipart_upload", "upload_part", "upload_part_copy",
              "abort_multipart_upload"}  # fmt: skip
_ONE_PATH = {"writer", "create", "replace", "publish", "delete", "put_object", "copy_object",
             "delete_object", "complete_multipart_upload"}  # fmt: skip


def _may_commit(op: str, path: str) -> bool:
    """Whether a write may change what the oracle reads (the lease, markers, manifests, and
    so which steps count). Not: a folder's creation, a part, a write or removal of one data
    file. Any other operation (on a folder, two paths, or unknown here) may."""
    if op in _NO_COMMIT:
        return False
    return op not in _ONE_PATH or path.endswith((MARKER, MANIFEST, LEASE))


def _world_of(spec: StorageSpec) -> tuple[World, str]:
    rest = spec.url.split("://", 1)[1]
    wid, _, path = rest.partition("/")
    return _WORLDS[wid], path


class SimFS(LocalStorage):
    """The real LocalStorage on a real folder; every operation passes the world's gate."""

    def __init__(self, spec: StorageSpec) -> None:
        self.world, path = _world_of(spec)
        super().__init__(StorageSpec(os.path.join(self.world.root, path), dict(spec.options)))
        self.spec = spec

    def sub(self, prefix: str) -> SimFS:
        return SimFS(self.spec.child(prefix))


class SimS3(S3Storage):
    """The real S3Storage on the world's in-memory S3 server."""

    def __init__(self, spec: StorageSpec) -> None:
        self.world, path = _world_of(spec)
        super().__init__(StorageSpec(f"s3://{path}", {**spec.options, "max_concurrency": 1}))
        self.client = self.world.client
        self.spec = spec

    def sub(self, prefix: str) -> SimS3:
        return SimS3(self.spec.child(prefix))

    def close(self) -> None:
        return None

    @property
    def pool(self) -> ThreadPoolExecutor:
        return _INLINE


class _Inline(ThreadPoolExecutor):
    """S3Storage's pool in the simulation: each call runs at once, in the caller's SimThread,
    so the copies, parts and aborts it sends in parallel pass the gate one by one, as the
    caller's process (a real pool thread ran them outside the lockstep, and whether it
    started the next copy before the caller cancelled it after a failure raced real time)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kw: Any) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kw))
        except BaseException as e:
            fut.set_exception(e)
        return fut


_INLINE = _Inline(1)  # no thread is ever started: submit runs the call


def _gated(name: str, mutates: bool, op: str | None = None) -> Callable:
    """`name` of LocalStorage behind the world's gate, as operation `op` (default: `name`)."""
    base = getattr(LocalStorage, name)

    def method(self: SimFS, path: str = "", *args: Any, **kw: Any) -> Any:
        th = SimThread.current()
        if th is not None and th.in_op:  # one operation is one gate (replace holds a flock
            return base(self, path, *args, **kw)  # across the read and publish it makes)
        outcome = self.world.gate(op or name, path, mutates)
        if outcome == "fail":
            raise OSError(errno.EIO, f"{path}: {name} failed (simulated)")
        if th is not None:
            th.in_op = True
        try:
            result = base(self, path, *args, **kw)
        finally:
            if th is not None:
                th.in_op = False
        if outcome == "after":
            raise Crash(name)
        return result

    method.__name__ = name
    return method


for _name, _mut in (
    ("create", True), ("replace", True), ("publish", True), ("delete", True),
    ("delete_prefix", True), ("move_prefix", True), ("makedirs", True), ("rename", True),
    ("read_tagged", False), ("read", False), ("size", False), ("list", False),
    ("walk", False), ("verify", False), ("sync_dir", False), ("writer", True),
):  # fmt: skip
    setattr(SimFS, _name, _gated(_name, _mut))
for _name in ("read_verified", "read_buffer"):  # one read each, gated as one (as they were)
    setattr(SimFS, _name, _gated(_name, False, "read"))

SCHEMES["simfs://"] = SimFS
SCHEMES["sims3://"] = SimS3
