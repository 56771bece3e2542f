"""A save's end: its manifest, its commit under the lease, what the commit sets going, and the
removal of an aborted save's files.

The coordinator decides when (after every unit reported its files; never an abort once the
commit may have landed); this part does the writing. What a commit sets going (retiring an
abandoned branch, a memory step's pin and persist, retention) runs as a follow-up task
(follow_ups.py), so a save cancelled in or after its commit still has it run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

import torch

from .. import __version__
from ..config import CheckpointConfig
from ..errors import CheckpointError, CheckpointSaveError
from ..memory.tier import MemoryTier
from ..steps import branch, commit, layout
from ..steps.lock import Lease
from ..storage import Storage
from . import follow_ups, unit_calls
from .components import Group, Unit
from .follow_ups import FollowUps
from .remote_errors import describe, save_error
from .results import SaveResult
from .runtime import Runtime
from .storage_calls import StorageCalls
from .timeline import Timeline
from .unit_calls import Newest

log = logging.getLogger("forge_ckpt")

Abandons = list[tuple[int, float]]


class Committer:
    """Commits and what surrounds them, for one coordinator (its folder, tier and lease)."""

    def __init__(
        self,
        config: CheckpointConfig,
        store: Storage,
        tier: MemoryTier | None,
        timeline: Timeline,
        lease: Lease,
        calls: StorageCalls,
        newest: Newest,
        runtime: Runtime,
    ) -> None:
        """`calls`: the coordinator's storage calls under its lease; `newest`: its newest
        committed step, for error messages."""
        self.config, self.store, self.tier, self.timeline = config, store, tier, timeline
        self.lease, self.newest, self.wall = lease, newest, runtime.wall
        self.io, self.under_lease = calls.io, calls.leased.run
        self.signer = config.signer
        # One commit at a time per store: a persist's durable commit (seconds on S3) never
        # holds up a memory save's commit; the lease has its own lock.
        self.locks = {"durable": runtime.lock(), "memory": runtime.lock()}
        self.follow_ups = FollowUps(self.follow_up, self.io, calls.running, timeline.committed)

    def manifest(
        self, groups: dict[str, Group], step: int, records: dict, seconds: dict, extra: Any
    ) -> layout.Manifest:
        """The step's manifest from what every unit reported it wrote."""
        comps = {}
        for name, group in groups.items():
            files = [f for u in group.units for f in records[(name, u.index)]]
            for f in files:  # what a unit reported must stay inside the step folder
                layout.check_relpath(f.path, f"{name}'s report")
            comps[name] = layout.Component(
                group.kind, len(group.units), files, seconds.get(name, 0.0)
            )
        return layout.Manifest(
            step=step,
            components=comps,
            extra=extra,
            fingerprint=self.config.fingerprint,
            versions={"forge_ckpt": __version__, "torch": torch.__version__},
            created=self.wall(),
            generation=self.lease.generation,
        )

    async def finish(
        self,
        result: SaveResult,
        groups: dict[str, Group],
        extra: Any,
        store: Storage,
        abandons: list[tuple[int, float]],
        *,
        durable: bool | None,
        begun: Awaitable[int] | None,
    ) -> SaveResult:
        """After the cut: every unit's files, the manifest, the commit; then what it sets
        going. Never an abort once the commit may have landed (`_may_abort`)."""
        units = [u for g in groups.values() for u in g.units]
        start = time.perf_counter() - result.blocked_s
        if begun is not None:  # deferred: the snapshots were awaited by nobody yet
            result.nbytes = await begun
        committing = False
        try:
            records = await unit_calls.poll_written(units, result, start, self.config, self.newest)
            manifest = self.manifest(groups, result.step, records, result.seconds, extra)
            manifest.supersedes = abandons
            if manifest.created in [t for s, t in abandons if s == result.step]:
                manifest.created += 1e-3  # never the abandoned step's identity
            commit_call = asyncio.ensure_future(self.io(self.commit, manifest, store))
            follow = self.follow_ups.start(commit_call, manifest, store, abandons, durable)
            committing = True  # from here on the step may become visible: never abort it
            await asyncio.shield(commit_call)
        except BaseException as e:
            if committing:
                follow.add_done_callback(follow_ups.log_failure(result.step))
            if _may_abort(committing, e):
                await self.abort(units, result.step, e, store)
                if isinstance(e, (OSError, ValueError)):
                    lines = [f"commit: {describe(e)}"]
                    raise save_error(self.newest(), result.step, lines) from e
                raise
            unknown = isinstance(e, OSError) or not isinstance(e, CheckpointError)
            if isinstance(e, Exception) and unknown:  # a definite refusal says so itself
                raise CheckpointSaveError(
                    f"step {result.step}: the commit failed and its outcome is unknown "
                    f"({describe(e)}); the step was left as it is: a load counts it if its "
                    "commit was recorded, and the next start removes it if not"
                ) from e
            raise
        result.nbytes = manifest.nbytes
        result.total_s = time.perf_counter() - start
        result.committed = True
        log.info(
            "committed step %d: %.1f MB in %.2fs", result.step, result.nbytes / 1e6, result.total_s
        )
        try:
            turn = await asyncio.shield(follow)
        except asyncio.CancelledError:
            follow.add_done_callback(follow_ups.log_failure(result.step))
            raise
        if turn is not None and not turn.done():  # a due save waits for the persist before
            await asyncio.wait([turn])  # its own (at most one waits its turn)
        return result

    def commit(self, manifest: layout.Manifest, store: Storage | None = None) -> None:
        """Commit under the lease (also the memory tier's persist: from its own thread)."""
        self.under_lease(self.commit_now, manifest, store)

    def commit_now(self, manifest: layout.Manifest, store: Storage | None) -> None:
        target = self.store if store is None else store
        with self.locks["durable" if target is self.store else "memory"]:
            commit.commit_step(target, manifest, self.lease.renew, self.signer)
            self.timeline.committed(target, manifest.step)

    async def follow_up(
        self, manifest: layout.Manifest, store: Storage, abandons: Abandons, durable: bool | None
    ) -> Any:
        """What a commit sets going (follow_ups.py runs it as a task of its own). Returns the
        persist a due memory step's persist waits for (the save waits for it too, outside
        that task: the next save waits for the task)."""
        if self.timeline.branch_from is not None and self.tier is not None:
            await self.retire_memory()
        self.timeline.branch_committed()
        if abandons:  # the abandoned one goes now
            try:
                await self.io(branch.retire_superseded, self.store)
            except (OSError, CheckpointError) as e:  # loads skip them; a later save removes them
                self.timeline.forget(self.store)  # their numbers are not free yet
                log.warning("could not yet remove the abandoned steps: %s", e)
        if self.tier is not None and store is not self.store:  # maybe persisted, later
            # (`store` is the tier's, maybe an older object of it: a node that joined
            # since replaced it; review 11, claim 7)
            persist = (self.commit, self.retention)
            return await self.tier.committed(manifest, self.store, persist, durable)
        await self.retention()
        return None

    async def retire_memory(self) -> None:
        """Remove the memory steps that a committed durable step of a newer branch abandoned
        (after that branch's first commit, and before each load: a driver may have died in
        between). Loads skip them meanwhile."""
        assert self.tier is not None
        try:
            for s in await self.io(branch.abandoned_copies, self.store, self.tier.store):
                await self.io(commit.remove_step, self.tier.store, s)
        except (OSError, CheckpointError) as e:  # (CheckpointError: closed meanwhile)
            log.warning("could not yet remove the abandoned branch's memory steps: %s", e)

    async def retention(self) -> None:
        """Best effort after a commit: a failure leaves extra steps, never a failed save (the
        step is committed); the next save tries again."""
        try:
            removed = await self.io(self.timeline.apply_retention)
        except (OSError, CheckpointError) as e:  # e.g. the lease, lost since the commit
            self.timeline.forget(self.store)  # abandoned steps may be left
            log.warning("retention could not run (the next save tries again): %s", e)
            return
        if removed:
            log.info("retention removed steps %s", removed)

    async def abort(
        self, units: list[Unit], step: int, error: BaseException, store: Storage
    ) -> None:
        """Stop every unit's part of a failed save, then remove the step's files."""
        await unit_calls.stop(units, error, self.config.abort_timeout_s)
        await self.discard(step, store)

    async def discard(self, step: int, store: Storage) -> None:
        """Remove an aborted step's files; a failure here must not hide the save's own error.
        Never without the lease: the folder may be another job's by now (it removes them)."""
        if not self.lease.held:
            log.warning("not removing the aborted step %d: the lease is no longer held", step)
            return
        try:
            await self.io(commit.remove_if_uncommitted, store, step)
            if store is self.store and self.timeline.branch_from is not None:
                await self.put_back()
        except (OSError, CheckpointError) as e:
            log.warning(
                "could not remove aborted step %s (%s); it is not committed and will be "
                "removed at the next start",
                store.where(layout.step_name(step)),
                e,
            )

    async def put_back(self) -> None:
        """A set-aside step (a rollback's save cut off mid-move) back in place."""
        try:
            await self.io(branch.put_back, self.store, self.lease)
            self.timeline.aside = False
        except (OSError, CheckpointError) as e:  # the next save, load or start puts it back
            log.warning("could not put a set-aside step back yet: %s", e)


def _may_abort(committing: bool, e: BaseException) -> bool:
    """Whether a failed save may abort (remove its step): only before its commit began, or
    when the commit says it wrote no COMMIT. A cancellation or an error after that may have
    come after the step became visible: removing it would lose a committed step."""
    return not committing or getattr(e, "not_committed", False)
