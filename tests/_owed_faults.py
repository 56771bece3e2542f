"""Shared by the owed follow-up tests (reviews 8 and 9): a commit whose reply is lost after it
landed, and a look at whether a commit landed (`follow_ups.committed_as`) that fails."""

from __future__ import annotations

import asyncio
import errno
import threading
from typing import Any

import pytest

from forge_ckpt.coordination import follow_ups
from forge_ckpt.steps import commit


def lose_replies(monkeypatch: Any, steps: set[int]) -> None:
    """The commit of each of `steps` lands (recorded in the lease), then its caller gets
    OSError once: a lost reply, an outcome the save cannot know."""
    real = commit.commit_step

    def lost(store: Any, manifest: Any, *args: Any) -> Any:
        out = real(store, manifest, *args)
        if manifest.step in steps:
            steps.discard(manifest.step)
            raise OSError(errno.EIO, "reply lost (test)")
        return out

    monkeypatch.setattr(commit, "commit_step", lost)


def failing_looks(monkeypatch: Any, n: int) -> None:
    """The next `n` looks at whether an owed commit landed fail with a read error."""
    real, left = follow_ups.committed_as, [n]

    def flaky(store: Any, manifest: Any) -> bool:
        if left[0]:
            left[0] -= 1
            raise OSError(errno.EIO, "read failed (test)")
        return real(store, manifest)

    monkeypatch.setattr(follow_ups, "committed_as", flaky)


async def wait_cancelled_in_its_look(coord: Any, monkeypatch: Any) -> None:
    """A `wait()` whose look at an owed commit is slow (S3 retries, say) is cancelled by its
    caller's deadline while the look is in flight; the look then ends."""
    real, entered, go = follow_ups.committed_as, threading.Event(), threading.Event()

    def slow_look(store: Any, manifest: Any) -> bool:
        entered.set()
        assert go.wait(60)
        return real(store, manifest)

    monkeypatch.setattr(follow_ups, "committed_as", slow_look)
    waiting = asyncio.ensure_future(coord.wait())
    assert await asyncio.to_thread(entered.wait, 60)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    go.set()
    monkeypatch.setattr(follow_ups, "committed_as", real)


async def commit_cut_by_the_loop(coord: Any) -> None:
    """A deferred save(1), then a deferred save(2) whose commit is held at its COMMIT until
    the background save is done: the end of the running loop cancels it there."""
    from _held_storage import hold

    await coord.save(1)
    await coord.wait()
    held = hold("create", "step-2/COMMIT")
    await coord.save(2)  # returns at the snapshots; the commit runs in `_pending`
    await held.reached()
    assert coord._pending is not None
    coord._pending.add_done_callback(lambda _t: held.go.set())  # let go once the loop cut it


def release_holds(coord: Any) -> None:
    """Let every held call go, forget the rules, close `coord`."""
    from _held_storage import HOLDS, RULES

    for h in HOLDS:
        h.go.set()
    RULES.clear()
    HOLDS.clear()
    coord.close()
