"""Load: choose a committed step of either tier, check it matches the job, prepare every unit,
then apply; all or nothing.

Everything that can refuse the load (the step's manifest, the differences with the job, each
unit's prepare: reading and verifying its files) runs before any unit applies; a failure
there leaves every component as it was. A damaged durable step is moved to `quarantine/` and
the next older one tried (`fallback`); a memory step with a lost copy is skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..config import CheckpointConfig
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from ..memory.choose import TIER, abandoned
from ..memory.choose import candidates as load_candidates
from ..memory.tier import MemoryTier
from ..steps import branch, commit, layout
from ..steps.signing import Signer
from ..storage import Storage
from . import components
from .apply import apply_all
from .components import Group
from .results import LoadResult
from .timeline import Timeline
from .unit_calls import Newest, run_all

log = logging.getLogger("forge_ckpt")

Io = Callable[..., Awaitable[Any]]  # a blocking storage call, off the loop, under the lease


class Loader:
    """The load path of one coordinator (its folder, memory tier, components and timeline)."""

    def __init__(
        self,
        config: CheckpointConfig,
        signer: Signer,
        store: Storage,
        tier: MemoryTier | None,
        timeline: Timeline,
        groups: dict[str, Group],
        io: Io,
        newest: Newest,
    ) -> None:
        self.config, self.signer, self.store = config, signer, store
        self.tier, self.timeline = tier, timeline
        self.groups = groups  # the coordinator's registry: what is registered at load time
        self.io, self.newest = io, newest

    async def load(
        self, step: int | None, exclude: set[str], allow_mismatch: bool
    ) -> LoadResult | None:
        """Load `step` (None: the newest committed whole step of either tier)."""
        marked = await self.io(self.timeline.loadable)
        mem = await self.io(self.tier.steps) if self.tier is not None else []
        if self.tier is not None:
            marked, mem = await self.io(self._live_across_tiers, marked, mem)
        if step is not None and step not in marked and step not in mem:
            raise CheckpointError(
                f"step {step} is not a committed step in {self.config.folder}; "
                f"committed steps: {self.timeline.steps() or 'none'}"
                + (f", in memory: {mem or 'none'}" if self.tier is not None else "")
            )
        candidates = load_candidates(mem, marked, step, self.config.fallback)
        # Read before anything is applied (a load is all or nothing): what a rollback to the
        # step loaded would abandon.
        oldest = min((c for _, c in candidates), default=None)
        newer = [] if oldest is None else await self.io(self._newer_than, oldest)
        for n, (in_mem, candidate) in enumerate(candidates):
            try:
                loaded = await self.load_step(candidate, exclude, allow_mismatch, in_mem)
            except CheckpointCorruptError as e:
                if n + 1 == len(candidates):
                    raise
                nxt = candidates[n + 1]
                if in_mem:  # a lost copy never comes back: nothing to move aside
                    log.warning("%s; loading %s step %d", e, TIER[nxt[0]], nxt[1])
                    continue
                log.warning("step %d is corrupt (%s); falling back to %sstep %d", candidate, e,
                            "memory " if nxt[0] else "", nxt[1])  # fmt: skip
                await self.io(commit.quarantine_step, self.store, candidate)
                continue
            self.timeline.branch_at(loaded.step, max([*marked, *mem], default=None), newer)
            return loaded
        return None

    def _live_across_tiers(self, marked: list[int], mem: list[int]) -> tuple[list, list]:
        """Less the steps of either tier that a committed step of the other abandoned (a
        rollback's first step is durable and names the abandoned memory steps; a driver
        may have died before removing them)."""
        assert self.tier is not None
        found = []
        for store, steps in ((self.tier.store, mem), (self.store, marked)):
            manifests = {}
            for s in steps:
                try:
                    manifests[s] = layout.read_committed(store, s)
                except CheckpointCorruptError:  # the load reports it
                    continue
            found.append(manifests)
        gone_mem, gone = abandoned(found[0], found[1])
        return [s for s in marked if s not in gone], [s for s in mem if s not in gone_mem]

    def _newer_than(self, step: int) -> list[tuple[int, float]]:
        """What a rollback to `step` abandons: every newer step with a marker, both tiers."""
        newer = branch.abandoned_by(self.store, step)
        if self.tier is not None:
            newer += branch.abandoned_by(self.tier.store, step)
        return sorted(set(newer))

    async def load_step(
        self, step: int, exclude: set[str], allow_mismatch: bool, in_mem: bool = False
    ) -> LoadResult:
        """Prepare every unit from `step` (all of them, or raise), then apply."""
        store, spec = self.store, self.config.storage
        if in_mem and self.tier is not None:  # every file must still have a copy somewhere
            store, spec = self.tier.store, self.tier.spec
            await self.io(self.tier.check_whole, step)
        where = spec.child(layout.step_name(step))
        manifest = await self.io(layout.read_committed, store, step, self.signer)
        self.check_matches(manifest, exclude, allow_mismatch)
        verify = self.config.verify_on_load
        plan = await components.load_plan(self.groups, manifest, exclude, where, verify)
        units = [p[0] for p in plan]
        calls = [u.prepare(where, recs, verify, opts) for u, recs, opts in plan]
        try:
            notes = await run_all(units, calls, step, "load", self.config, self.newest)
        except GeneratorExit:  # closed unrun by a dropped loop: nothing can be awaited
            raise
        except BaseException:
            await asyncio.gather(*(u.abort() for u in units), return_exceptions=True)
            raise
        accepted = (f"{u.name}: {n}" for u, ns in zip(units, notes, strict=True) for n in ns)
        for line in dict.fromkeys(accepted):  # once per component, not per replica
            log.warning("loading despite a difference the component accepts: %s", line)
        await apply_all(units, step, self.config.load_timeout_s)
        log.info("loaded step %d from %s", step, where.url)
        return LoadResult(step, manifest.extra, where.url, manifest, TIER[in_mem])

    def check_matches(self, manifest: layout.Manifest, exclude: set[str], allow: bool) -> None:
        """Raise CheckpointMismatchError listing every difference."""
        diffs = []
        fp = self.config.fingerprint
        if fp is not None and manifest.fingerprint is not None and fp != manifest.fingerprint:
            diffs.append(
                f"run fingerprint changed: checkpoint={manifest.fingerprint}, current={fp}"
                " (the folder holds another run's checkpoints)"
            )
        diffs += components.differences(self.groups, manifest, exclude)
        if diffs and not allow:
            raise CheckpointMismatchError(diffs)
        for d in diffs:
            log.warning("loading despite mismatch: %s", d)
