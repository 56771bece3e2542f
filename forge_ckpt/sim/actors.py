"""Simulated actors: a Ray-like handle (`handle.method.remote(...)` submits now, runs the calls
one at a time in submission order, in the actor's own process) around a real
`Checkpointable` component, so the coordinator's RemoteUnit and the actor-side save and load
code run unchanged."""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from typing import Any

from ..actors.checkpointable import Checkpointable, StorageSpec
from .loop import Crash, run_io
from .world import PROC, Proc, World


class ActorDied(RuntimeError):
    """What a call to a dead actor raises (Ray's ActorDiedError)."""


class Component(Checkpointable):
    """A component whose state is the version the job last gave it (the step it trained)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.version = 0
        self.loads = 0

    def set_version(self, v: int) -> None:
        self.version = v

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "pad": bytes(64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        self.loads += 1  # what a load applied (training calls change `version` too)

    def forge_begin_save(
        self, where: StorageSpec, relpath: str, background: bool, defer: bool = False
    ) -> dict:
        # The write runs in this call (a background thread would run outside the lockstep).
        return super().forge_begin_save(where, relpath, False, defer)


class _Method:
    def __init__(self, actor: SimActor, name: str) -> None:
        self._actor, self._name = actor, name

    def remote(self, *args: Any) -> asyncio.Future:
        return self._actor.submit(self._name, args)


class SimActor:
    def __init__(self, world: World, proc: Proc, obj: Any) -> None:
        self._world, self.proc, self.obj = world, proc, obj
        self._queue: deque[tuple[str, tuple, asyncio.Future]] = deque()
        self._busy = False

    def __getattr__(self, name: str) -> _Method:
        getattr(self.obj, name)  # AttributeError for what the actor does not have
        return _Method(self, name)

    def submit(self, name: str, args: tuple) -> asyncio.Future:
        fut = self._world.loop.create_future()
        self._queue.append((name, args, fut))
        if not self._busy:
            self._busy = True
            ctx = contextvars.copy_context()
            ctx.run(PROC.set, self.proc)
            task = ctx.run(self._world.loop.create_task, self._serve())
            self.proc.tasks.append(task)
        return fut

    async def _serve(self) -> None:
        try:
            while self._queue:
                name, args, fut = self._queue.popleft()
                if not self.proc.alive:
                    _settle(fut, ActorDied(f"actor {self.proc.name} died"))
                    continue
                try:
                    result = await run_io(getattr(self.obj, name), *args)
                except (Crash, asyncio.CancelledError):
                    _settle(fut, ActorDied(f"actor {self.proc.name} died"))
                    continue
                except BaseException as e:
                    _settle(fut, e)
                    continue
                if not fut.done():
                    fut.set_result(result)
        finally:
            self._busy = False
            while self._queue:  # cancelled with calls queued: they die with the actor
                _settle(self._queue.popleft()[2], ActorDied(f"actor {self.proc.name} died"))


def _settle(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
