"""Review 7: a coordinator serving several `asyncio.run()` calls in turn, where the first one
returns while a save's post-commit task (`_follow`) waits in its pin call. The loop's end
cancels that task; `MemoryTier.committed` then starts the step's persist in its `finally`,
on a loop that is shutting down (after `asyncio.run` gathered the tasks it cancels).

One node's local Ray; holders keep one copy (`memory_copies=1`).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from _persist_holds import Counter

from forge_ckpt import CheckpointConfig, CheckpointCoordinator
from forge_ckpt.memory.store import MemoryStorage
from forge_ckpt.steps import commit

WAIT_S = 60.0


@pytest.fixture(scope="module")
def counter(ray_local):
    return Counter.remote()


def pins(coord: CheckpointCoordinator) -> dict[str, Any]:
    return {ref[1][:8]: info["pinned"] for ref, info in coord.tier.store.on_all("info")}


def test_a_loop_that_ends_in_the_follow_tasks_pin_leaves_the_step_pinned(
    counter, tmp_path, monkeypatch
):
    """The first `asyncio.run()` returns while save(1)'s pin call is in its thread (a slow
    holder); the pin is let go once the loop's end has cancelled the follow task. That
    task started step 1's persist on the dying loop (it failed: "Executor shutdown has
    been called", and its unpin with it). It now starts none there: the next loop's first
    call runs the follow-up again. The second `asyncio.run()` saves step 2 and waits: both
    steps durable, no step pinned for good, no task of the first loop left in the chain."""
    coord = CheckpointCoordinator(CheckpointConfig(folder=str(tmp_path / "ckpt"),
                                  memory_every=1, durable_every=1, memory_copies=1))  # fmt: skip
    coord.register("counter", counter)
    store = coord.tier.store
    real = store.on_all
    entered = threading.Event()
    follows: list[Any] = []

    def held(method: str, *args: Any, **kw: Any) -> Any:
        if method == "pin" and args == (1, True) and not entered.is_set():
            entered.set()
            for _ in range(int(WAIT_S / 0.01)):  # until the loop's end cancelled the follow
                if follows and all(t.done() for t in follows):
                    break
                threading.Event().wait(0.01)
        return real(method, *args, **kw)

    monkeypatch.setattr(store, "on_all", held)

    async def first() -> None:
        await counter.set.remote(1)
        asyncio.ensure_future(coord.save(1))
        assert await asyncio.to_thread(entered.wait, WAIT_S)
        follows.extend(coord._follow_ups.tasks)

    async def second() -> tuple[list[int], Any, str]:
        error = "none"
        try:
            await coord.wait()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        await counter.set.remote(2)
        await asyncio.wait_for(coord.save(2), WAIT_S)
        await asyncio.wait_for(coord.wait(), WAIT_S)
        return coord.steps(), await asyncio.to_thread(pins, coord), error

    asyncio.run(first())
    left = [t for t in coord.tier._chain if not t.done()]
    durable, pinned, error = asyncio.run(second())
    coord.close()
    print(f"left in the chain {left}; durable {durable}; pins {pinned}; first wait(): {error}")
    assert follows, "no follow task was running"
    assert not left, f"tasks of the ended loop left in the tier's chain: {left}"
    assert durable == [1, 2], f"durable {durable}"
    assert all(not p for p in pinned.values()), f"steps stay pinned: {pinned}"


def test_a_loop_that_ends_in_the_memory_commit_still_persists_the_step(
    counter, tmp_path, monkeypatch
):
    """The first `asyncio.run()` returns while save(1)'s memory commit runs in its thread:
    the loop's end cancels the follow task in its wait for the commit, where it returns
    None (`except BaseException`), and the commit then completes. The second
    `asyncio.run()` retries save(1), told "already committed": step 1 must still be pinned
    and persisted (the change's goal, here with the loop's end instead of a deadline)."""
    coord = CheckpointCoordinator(CheckpointConfig(folder=str(tmp_path / "ckpt"),
                                  memory_every=1, durable_every=1, memory_copies=1))  # fmt: skip
    coord.register("counter", counter)
    entered = threading.Event()
    real = commit.commit_step
    follows: list[Any] = []

    def held(store: Any, manifest: Any, *args: Any) -> Any:
        if isinstance(store, MemoryStorage) and manifest.step == 1:
            entered.set()
            for _ in range(int(WAIT_S / 0.01)):  # until the loop's end cancelled the follow
                if follows and all(t.done() for t in follows):
                    break
                threading.Event().wait(0.01)
        return real(store, manifest, *args)

    monkeypatch.setattr(commit, "commit_step", held)

    async def first() -> None:
        await counter.set.remote(1)
        asyncio.ensure_future(coord.save(1))
        assert await asyncio.to_thread(entered.wait, WAIT_S)
        follows.extend(coord._follow_ups.tasks)

    async def second() -> tuple[bool, list[int]]:
        retried = (await asyncio.wait_for(coord.save(1), WAIT_S)).committed
        await asyncio.wait_for(coord.wait(), WAIT_S)
        return retried, coord.steps()

    asyncio.run(first())
    retried, durable = asyncio.run(second())
    coord.close()
    print(f"follow tasks {follows}; retry committed {retried}; durable {durable}")
    assert follows, "no follow task was running"
    assert durable == [1], f"step 1 committed in memory, never persisted: durable {durable}"
