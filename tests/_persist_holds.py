"""Shared by the memory tier's review tests: a counter actor, a storage call of the driver
held in its thread (a slow S3 call), and a save cancelled once its step is pinned (a
caller's deadline)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
import ray

from forge_ckpt import Checkpointable, CheckpointCoordinator
from forge_ckpt.steps import commit


@ray.remote(num_cpus=0)
class Counter(Checkpointable):
    def __init__(self) -> None:
        self.n, self.fail = 0, False

    def set(self, n: int, fail: bool = False) -> None:
        self.n, self.fail = n, fail

    def get(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        if self.fail:
            raise RuntimeError("snapshot failed (test)")
        return {"n": self.n, "pad": np.zeros(10, dtype=np.float32)}

    def load_state_dict(self, state: dict) -> None:
        self.n = int(state["n"])


def hold(
    monkeypatch: Any, name: str, store: Any, step: int | None = None
) -> tuple[threading.Event, threading.Event]:
    """`commit.<name>(store, manifest or step, ...)` on `store` (for `step` only, if given)
    waits in its thread until `go` is set; `entered` says one is waiting."""
    entered, go = threading.Event(), threading.Event()
    real = getattr(commit, name)

    def held(on: Any, what: Any, *args: Any) -> Any:
        number = getattr(what, "step", what)
        if _same(on, store) and (step is None or number == step):
            entered.set()
            assert go.wait(300)
        return real(on, what, *args)

    monkeypatch.setattr(commit, name, held)
    return entered, go


def _same(on: Any, store: Any) -> bool:
    """`on` is `store`, or, for the memory tier, the storage of one of its save attempts
    (`MemoryTier.attempt`: the same holders, with the attempt's token)."""
    from forge_ckpt.memory.store import MemoryStorage

    mem = isinstance(on, MemoryStorage) and isinstance(store, MemoryStorage)
    return on is store or (mem and on.url == store.url)


async def cancel_once_pinned(coord: CheckpointCoordinator, counter: Any, step: int) -> None:
    """save(step), cancelled once its committed memory step is pinned (it then waits for
    the persist before it, or is in its pin call)."""
    await counter.set.remote(step)
    saving = asyncio.ensure_future(coord.save(step))
    while step not in coord.tier._pinned:
        await asyncio.sleep(0.01)
    for _ in range(20):
        await asyncio.sleep(0)
    saving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await saving
