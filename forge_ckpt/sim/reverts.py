"""Fixes taken back out, one at a time, to show that the simulation finds what each fixed
(`python -m forge_ckpt.sim --revert NAME`, tests/test_sim.py). Each undoes one fix in this
process only, by replacing the fixed function with the old behaviour."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..coordination import committer, timeline
from ..memory.holder import Holder
from ..memory.tier import MemoryTier
from ..steps import branch, commit, layout, lock
from ..storage.s3 import S3Storage


def _abort_after_commit() -> None:
    """Fix 1: a save that fails or is cancelled during its commit aborts, and the abort
    removes the step whatever it holds (close() removed the step it waited for)."""

    def remove_anyway(store: Any, step: int) -> bool:
        store.delete_prefix(layout.step_name(step))
        return True

    committer._may_abort = lambda committing, e: True
    commit.remove_if_uncommitted = remove_anyway


def _retire_at_once() -> None:
    """Fix 2: the first save after load(step=K) retires the newer steps before it commits."""

    def retire_now(store: Any, branch_from: int) -> list:
        commit.retire_after(store, branch_from)
        return []

    branch.abandoned_by = retire_now


def _own_write_is_another() -> None:
    """Fix 7: a conditional write whose reply was lost, retried, meets its own write and
    reads as another writer's."""
    S3Storage._applied = lambda self, path, data: None  # type: ignore[method-assign]
    lock.Lease._own_write = lambda self, data: None  # type: ignore[method-assign]


def _every_marker_counts() -> None:
    """Fix 8: readers count every COMMIT, not only those the lease records."""
    layout.Fence.admits = lambda self, step: True  # type: ignore[method-assign]
    layout.Fence.problem = lambda self, step, marker: None  # type: ignore[method-assign]


def _memory_ignores_durable() -> None:
    """Fix 3: a save to the memory tier checks only the memory steps, not whether a newer
    durable step exists (save(1) was accepted on a folder whose newest durable step is 10)."""
    timeline._behind = lambda store, durable: [store]


def _retention_drops_pinned() -> None:
    """Fix 4: memory retention keeps the newest `memory_keep` steps and drops the rest, a
    step still waiting to be persisted included (its persist then finds no copy left)."""

    def retention(self: MemoryTier, step: int) -> None:
        self._recent = sorted({*(self._recent or self.steps()), step})
        keep = commit.RetentionPolicy(keep_last=self.config.memory_keep)
        for old in keep.to_delete(self._recent):
            commit.remove_step(self.store, old)
            self._recent.remove(old)

    MemoryTier._retention = retention  # type: ignore[method-assign]


def _load_raises_persist_failure() -> None:
    """Fix 5: load() raises the failure of a background persist (a job that lost nodes while
    persisting cannot recover) instead of logging it and loading the newest whole step."""
    settle = MemoryTier.settle

    async def raising(self: MemoryTier) -> BaseException | None:
        failure = await settle(self)
        if failure is not None:
            raise failure
        return None

    MemoryTier.settle = raising  # type: ignore[method-assign]


def _prepare_trusts_its_start() -> None:
    """A step's preparation checks the lease only before it makes the step's folders: a job
    whose preparation stalled past its lease has its actors write into the step its
    successor is preparing, whose create-only write then fails its save as "another writer"
    (I7; found past the budget, sim seeds 28030 and 52652 before the seeds shifted)."""
    commit._still_ours = lambda store, step: None


def _memory_deletes_trust_the_caller() -> None:
    """The memory tier (a store fenced by its caller's lease) deletes without renewing that
    lease first: a stale job's save removes its successor's memory step in progress as a
    leftover, or its retention removes the successor's step of that number (I1; seed 16233
    before the seeds shifted). The holders' fence by lease generation, which refuses those
    removals too, goes with it (either alone keeps them out)."""
    commit.before_delete = lambda: None
    Holder._admit = lambda self, where, token, step, write: True  # type: ignore[method-assign]


REVERTS: dict[str, Callable[[], None]] = {
    "fix1": _abort_after_commit,
    "fix2": _retire_at_once,
    "fix3": _memory_ignores_durable,
    "fix4": _retention_drops_pinned,
    "fix5": _load_raises_persist_failure,
    "fix7": _own_write_is_another,
    "fix8": _every_marker_counts,
    "stale-prepare": _prepare_trusts_its_start,
    "stale-memory-delete": _memory_deletes_trust_the_caller,
}
