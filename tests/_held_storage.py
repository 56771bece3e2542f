"""Storage and actors for protocol tests that force races with events, never with timing.

`held://<folder>` is a LocalStorage whose calls first consult RULES: a call can be held on a
threading.Event until the test lets it go, or fail (EIO, before it applies). A rule matches
an operation and the suffix of the call's full path (actors open the step folder itself, so
a relative path would not say which step), an actor file named without its save attempt. Clock is a wall clock a test moves by hand (the
lease's expiry); Handle runs a local object's methods in threads, as Ray actors run
concurrently. Tests use the `held_rules` fixture, which clears the rules and lets every hold
go at the end, so a failed test never leaves a storage thread waiting."""

from __future__ import annotations

import asyncio
import errno
import re
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest_asyncio

from forge_ckpt import CheckpointConfig, CheckpointCoordinator
from forge_ckpt.actors.checkpointable import Checkpointable
from forge_ckpt.coordination.runtime import Runtime
from forge_ckpt.storage import SCHEMES, StorageSpec
from forge_ckpt.storage.local import LocalStorage

WAIT_S = 60.0  # the bound on every wait: a hold never let go fails the test, never hangs it

Rule = tuple[str, str, Callable[[str], None]]  # (operation, full-path suffix, action)
RULES: list[Rule] = []
LOG: list[tuple[str, str]] = []  # (operation, path relative to its storage), in call order
HOLDS: list[Hold] = []
_MUTATING = ("create", "replace", "delete", "delete_prefix", "publish", "writer", "move_prefix")


class HeldFS(LocalStorage):
    """LocalStorage whose operations consult RULES first (hold on an event, or fail)."""

    def __init__(self, spec: StorageSpec) -> None:
        super().__init__(StorageSpec(spec.url.removeprefix("held://"), dict(spec.options)))
        self.spec = spec

    def sub(self, prefix: str) -> HeldFS:
        return HeldFS(self.spec.child(prefix))


def _wrap(name: str) -> Any:
    base = getattr(LocalStorage, name)

    def method(self: HeldFS, path: str = "", *args: Any, **kw: Any) -> Any:
        full = self._p(path)
        for op, suffix, action in list(RULES):
            if op == name and without_attempt(full).endswith(suffix):
                action(full)
        if name in _MUTATING:
            LOG.append((name, path))
        return base(self, path, *args, **kw)

    return method


def without_attempt(path: str) -> str:
    """`path` with an actor file's save attempt taken out of its name (layout.actor_file): a
    rule names `actors/c0.0.msgpack` for the file of whichever attempt."""
    return re.sub(r"\.g\d+s\d+\.msgpack$", ".msgpack", path)


for _name in (*_MUTATING, "read", "makedirs"):
    setattr(HeldFS, _name, _wrap(_name))
SCHEMES["held://"] = HeldFS


@dataclass
class Hold:
    """One held call: `entered` is set once it waits, `go` lets it go on."""

    go: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)

    async def reached(self) -> None:
        """Wait (bounded, off the event loop) until the held call is waiting."""
        assert await asyncio.to_thread(self.entered.wait, WAIT_S), "the held call never came"


def hold(op: str, suffix: str, only: Callable[[], bool] = lambda: True) -> Hold:
    """The first matching call for which `only()` is true waits until `go` is set; the rest
    pass."""
    held, used = Hold(), [False]

    def action(path: str) -> None:
        if used[0] or not only():
            return
        used[0] = True
        held.entered.set()
        assert held.go.wait(WAIT_S), f"{op} {path} was never let go"

    RULES.append((op, suffix, action))
    HOLDS.append(held)
    return held


def fail(op: str, suffix: str, times: int = 1) -> None:
    """The next `times` matching calls fail with EIO before they apply."""
    left = [times]

    def action(path: str) -> None:
        if left[0] > 0:
            left[0] -= 1
            raise OSError(errno.EIO, f"{op} {path}: failed (test)")

    RULES.append((op, suffix, action))


@pytest_asyncio.fixture
async def held_rules() -> AsyncIterator[list[Rule]]:
    """No rules before the test; after it, every hold let go and the rules cleared. Async:
    its teardown runs before the test's event loop closes, which waits for held threads."""
    RULES.clear()
    LOG.clear()
    HOLDS.clear()
    yield RULES
    for held in HOLDS:
        held.go.set()
    RULES.clear()
    HOLDS.clear()


def held_config(folder: Any, **kw: Any) -> CheckpointConfig:
    cfg = CheckpointConfig(folder=str(folder), **kw)
    cfg.folder = f"held://{cfg.folder}"  # normalize_url made the path absolute
    return cfg


class Clock:
    """A wall clock moved by hand; every reading is a little later than the last (so two
    manifests' `created` always differ, as on a real clock)."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


def job(folder: Any, wall: Callable[[], float], host: str, **kw: Any) -> CheckpointCoordinator:
    """A job on its own (simulated) machine: only the lease's expiry on `wall` tells another
    job that it is gone. The test renews its lease (no renewal thread)."""
    identity = {"host": host, "pid": 1, "pid_start": "1"}
    runtime = Runtime(wall=wall, lease_thread=False, identity=identity)
    kw.setdefault("max_clock_skew_s", 0.0)  # the jobs share the test's one clock
    return CheckpointCoordinator(held_config(folder, **kw), runtime=runtime)


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> asyncio.Future:
        return asyncio.ensure_future(asyncio.to_thread(self.fn, *args))


class Handle:
    """A Ray-like handle: each call runs in its own thread (an actor's write can block while
    the rest of the job goes on)."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._obj, name))


class Comp(Checkpointable):
    """A component that writes its own file (a Checkpointable actor): `version` tells apart
    which job or branch saved a step."""

    def __init__(self, version: int = 0) -> None:
        self.version = version

    def state_dict(self) -> dict:
        return {"version": self.version, "pad": bytes(64)}

    def load_state_dict(self, state: dict) -> None:
        self.version = int(state["version"])


class SlowReply(Comp):
    """Its begin-save call for step `step` writes the file, then answers only once let go
    (`go`), once `armed`; `entered` is set when it waits."""

    def __init__(self, version: int, step: int) -> None:
        super().__init__(version)
        self.step = step
        self.entered, self.go, self.armed = threading.Event(), threading.Event(), False

    def forge_begin_save(self, where: Any, relpath: str, background: bool, defer: bool = False):
        out = super().forge_begin_save(where, relpath, background, defer)
        if self.armed and where.url.endswith(f"step-{self.step}"):
            self.armed = False
            self.entered.set()
            assert self.go.wait(WAIT_S)
        return out


def looking_at_calls(coord: Any) -> threading.Event:
    """Set once `coord` looks at its running storage calls while one runs: what it does
    before it waits for the calls an earlier event loop left running (review 9, review 12)."""
    looked, base = threading.Event(), type(coord._calls)

    class Watched(base):  # type: ignore[misc, valid-type]
        @property
        def busy(self) -> int:
            n = base.busy.fget(self)  # type: ignore[attr-defined]
            if n:
                looked.set()
            return n

    coord._calls.__class__ = Watched
    return looked
