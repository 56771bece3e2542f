"""`CheckpointCoordinator`: saves the trainer and every registered actor as one atomic step.

Reads top to bottom: opening the folder (lease, crash leftovers), registration, save
(snapshot phase, persist phase, commit, retention; abort on failure), load (choose a step,
check it matches the job, prepare every unit, then apply), and lifetime.

Timelines: "newest" is the step committed last. Step numbers only grow along a timeline, so
the newest is also the highest number, with one exception that the coordinator resolves: after
`load(step=K)` with newer steps in the folder (a rollback), the first save starts a new branch
whose manifest names the steps it abandons; they stay until it commits and are removed right
after (branch.py), so a failed save loses nothing and the abandoned branch is never resumed.

The protocol's rules and the invariants the simulation (forge_ckpt.sim) checks are in
docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import torch

from . import __version__, branch, commit, components, layout
from .components import Group, Unit, actor_group, trainer_group
from .config import CheckpointConfig
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
)
from .events import Events
from .lock import CURRENT as CURRENT_LEASE
from .lock import Lease
from .memory.choose import TIER, abandoned
from .memory.choose import candidates as load_candidates
from .memory.tier import open_tier
from .remote_errors import describe, gather_units, save_error
from .reshard import ReshardRule
from .results import LoadResult, SaveResult
from .runtime import DEFAULT, Runtime
from .storage import FileRecord, Storage, StorageSpec, open_storage
from .storage.base import BEFORE_DELETE

log = logging.getLogger("forge_ckpt")


class CheckpointCoordinator:
    """Orchestrates save and load of one RL job; the only writer of its checkpoint folder."""

    def __init__(self, config: CheckpointConfig, *, runtime: Runtime = DEFAULT) -> None:
        """`runtime`: threads and clocks (forge_ckpt.sim passes its deterministic ones)."""
        self.config = config
        self._rt = runtime
        # close() never releases the lease while a storage call of ours runs: it asks the
        # last one to, when it ends (_under_lease).
        self._state = threading.Lock()  # held only for a few lines, never across I/O
        self._busy = 0
        self._close_requested = False
        self._closed = False
        self.store = open_storage(config.storage)
        self._signer = config.signer
        self._lease = Lease(
            self.store,
            config.lease_ttl_s,
            clock=runtime.wall,
            renew_in_background=runtime.lease_thread,
            identity=runtime.identity,
            lock=runtime.lock,
        )
        try:
            self.store.makedirs("")
            self._lease.acquire()
            self._under_lease(commit.remove_uncommitted, self.store)
            self._under_lease(branch.recover, self.store, self._lease)
        except OSError as e:
            self._lease.release()
            raise CheckpointError(
                f"cannot open checkpoint folder {config.folder}: {e}. The folder must be "
                "writable by this job (it takes a lease and removes crash leftovers)"
            ) from e
        except BaseException:
            self._lease.release()
            raise
        self._groups: dict[str, Group] = {}
        self._pending: asyncio.Task | None = None
        self._branch_from: int | None = None  # set by a load of an older step (rollback)
        self._abandons: list[tuple[int, float]] = []  # what the rollback found newer
        # store url -> a step no newer than which anything is committed there (we are the
        # only writer): a save of a newer step skips listing the steps before its cut.
        self._newest_seen: dict[str, int] = {}
        self._commit_lock = runtime.lock()  # one commit at a time (a save's, a persist's)
        self._events = Events(config.on_event)  # one record per save and load (events.py)
        # None: no memory tier
        self.tier = open_tier(config, self._lease.release, self.store, runtime.to_thread)
        if self.tier is not None:
            self.tier.io = self._io

    async def _io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A blocking storage call, off the event loop, under this coordinator's lease."""
        return await self._rt.to_thread(self._under_lease, fn, *args)

    def _under_lease(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a storage call of this coordinator: refused once close() was asked for; one
        running when close() is asked for keeps the lease until it ends (the last one to end
        releases it), so nothing is ever written to the folder after the release."""
        with self._state:
            if self._closed or self._close_requested:
                raise CheckpointError("this CheckpointCoordinator is closed")
            self._busy += 1
        token = CURRENT_LEASE.set(self._lease)
        fence = BEFORE_DELETE.set(self._fresh_lease)
        try:
            return fn(*args)
        finally:
            BEFORE_DELETE.reset(fence)
            CURRENT_LEASE.reset(token)
            with self._state:
                self._busy -= 1
                release = self._close_requested and self._busy == 0 and not self._closed
                self._closed = self._closed or release
            if release:
                self._release()

    def _fresh_lease(self) -> None:
        """Before a delete request: the lease is still held, renewed just now (lock.FRESH_S)."""
        self._lease.check(fresh=True)

    # ---- registration -------------------------------------------------------------------

    def set_trainer(self, trainer: Any | Sequence[Any]) -> None:
        """One trainer actor, or the rank actors of one torch.distributed job (in rank order)."""
        ranks = list(trainer) if isinstance(trainer, (list, tuple)) else [trainer]
        self._groups[layout.TRAINER] = trainer_group(ranks)

    def register(
        self,
        name: str,
        actor: Any | Sequence[Any],
        replace: bool = False,
        *,
        reshard: ReshardRule | None = None,
        optional: bool = False,
    ) -> None:
        """An actor with state_dict/load_state_dict; a list registers replicas (kept apart).

        `replace=True` swaps in a restarted actor under a name already registered. `reshard`
        turns N saved replica states into as many as registered now (else the actor class's
        `reshard_states`, if any; see forge_ckpt.reshard); `optional=True` lets a checkpoint
        without this component load, the actor keeping its fresh state."""
        layout.check_name(name)
        if name in self._groups and not replace:
            raise ValueError(
                f"a component named {name!r} is already registered; pass replace=True to swap "
                "in a restarted actor"
            )
        handles = list(actor) if isinstance(actor, (list, tuple)) else [actor]
        if not handles:
            raise ValueError(f"register({name!r}, []) needs at least one actor")
        self._groups[name] = actor_group(name, handles, reshard, optional)

    # ---- save ---------------------------------------------------------------------------

    async def save(
        self, step: int, extra: Any = None, *, durable: bool | None = None
    ) -> SaveResult:
        """Save every component at `step` and commit. Sync mode: returns after the commit.
        Async mode: returns once every component holds its snapshot; `wait()` flushes.
        Deferred mode: returns once every snapshot call is submitted (the cut: Ray runs the
        driver's later calls to each actor after it); a trainer rank's copy runs meanwhile
        and its next optimizer step waits for it. With the memory tier, `durable` says
        whether this step is also persisted (default: every `durable_every`-th save).
        Emits one `CheckpointEvent` (async modes: when the background part ends)."""
        started, tier = time.perf_counter(), TIER[self.tier is not None]
        try:
            result = await self._save(step, extra, durable=durable)
        except BaseException as e:
            self._events.failed("save", step, tier, started, e)
            raise
        pending = self._pending
        if result.committed or pending is None:
            self._events.saved(result, tier)
        else:
            pending.add_done_callback(lambda t: self._events.background(t, result, tier, started))
        return result

    async def _save(
        self, step: int, extra: Any = None, *, durable: bool | None = None
    ) -> SaveResult:
        """The save itself; `save` emits its event."""
        await self.wait(persisting=False)
        self._check_open()
        store, spec = self._target(self.tier is not None)
        where = spec.child(layout.step_name(step))
        mode = self.config.async_mode
        background = defer = mode != "sync"  # a config's "async" is mapped to "deferred"
        start = time.perf_counter()
        prepared = False  # only a folder this save prepared is ever removed by its abort
        try:
            plan = await self._io(self._check_step, step, store)
            if plan is None:
                return SaveResult(step, where.url, committed=True)
            prepared = True
            await self._io(commit.prepare_step, store, step)
        except OSError as e:
            if prepared:
                await self._discard(step, store)
            elif self._branch_from is not None and store is self.store:
                await self._put_back()  # a set-aside move that failed half-way
            lines = [f"preparing the step: {describe(e)}"]
            raise save_error(self._newest(), step, lines) from e
        groups = dict(self._groups)  # what this save holds, whatever register() does meanwhile
        units = [u for g in groups.values() for u in g.units]
        calls = [u.begin(where, background, defer) for u in units]  # submitted: the cut
        begun = self._snapshots(units, calls, step, store)
        result = SaveResult(step, where.url)
        if not defer:
            result.nbytes = await begun
        result.blocked_s = time.perf_counter() - start
        finish = self._finish_save(
            result,
            groups,
            extra,
            store,
            plan,
            durable=durable,
            begun=begun if defer else None,
        )
        if not background:
            return await finish
        self._pending = asyncio.create_task(finish)
        self._pending.add_done_callback(_log_background_failure)
        return result

    async def _snapshots(
        self, units: list[Unit], calls: list[Awaitable], step: int, store: Storage
    ) -> int:
        """The snapshots' total size (their calls are already submitted); a failure aborts."""
        try:
            return sum(await self._all(units, None, step, "snapshot", calls))
        except BaseException as e:
            await self._abort(units, step, e, store)
            raise

    def _target(self, memory: bool) -> tuple[Storage, StorageSpec]:
        """The memory tier's storage or the durable folder's."""
        if memory and self.tier is not None:
            return self.tier.store, self.tier.spec
        return self.store, self.config.storage

    def _check_step(self, step: int, store: Storage) -> list[tuple[int, float]] | None:
        """None if `step` is already committed; else the steps this save abandons (after a
        rollback). Refuses a step older than the newest of either tier. A step of the
        abandoned branch with this very number is replaced explicitly: it goes first."""
        if self._branch_from is not None and step > self._branch_from:
            # What the rollback saw, not what is there now: a step of this new branch whose
            # commit's outcome was unknown is newer than the branch point too.
            abandons = list(self._abandons)
            old = [t for s, t in abandons if s == step]
            if old and branch.is_present(self.store, step, old[0]):
                log.warning("rollback: setting step %d of the abandoned branch aside", step)
                branch.set_aside(self.store, step)
            if self.tier is not None and layout.all_steps(self.tier.store).count(step):
                commit.remove_step(self.tier.store, step)  # its number; the rest stay till the
            return abandons  # commit: they may be the only copies (durable_every > 1)
        if step > self._newest_seen.get(store.url, step):
            return []
        newest = 0
        for s in _behind(store, self.store):
            committed = branch.live_steps(s)
            if s is store and step in committed:
                log.warning("step %d is already committed; nothing to save", step)
                return None
            newest = max(newest, committed[-1] if committed else 0)
        self._newest_seen[store.url] = newest
        if store is self.store and step in branch.superseded(store):
            commit.remove_step(store, step)  # abandoned by a committed branch: free number
        if step < newest:
            raise CheckpointSaveError(
                f"cannot save step {step}: step {newest} is newer in "
                f"{self.config.folder}. To branch from an older step, load(step=...) it first "
                "(the newer steps are then retired once the first save of the new branch "
                "commits)"
            )
        return []

    async def _finish_save(
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
        units = [u for g in groups.values() for u in g.units]
        start = time.perf_counter() - result.blocked_s
        if begun is not None:  # deferred: the snapshots were awaited by nobody yet
            result.nbytes = await begun
        committing = False
        try:
            records = await self._persisted(units, result, start)
            manifest = self._manifest(groups, result.step, records, result.seconds, extra)
            manifest.supersedes = abandons
            if manifest.created in [t for s, t in abandons if s == result.step]:
                manifest.created += 1e-3  # never the abandoned step's identity
            committing = True  # from here on the step may become visible: never abort it
            await self._io(self._commit, manifest, store)
        except BaseException as e:
            if _may_abort(committing, e):
                await self._abort(units, result.step, e, store)
                if isinstance(e, (OSError, ValueError)):
                    lines = [f"commit: {describe(e)}"]
                    raise save_error(self._newest(), result.step, lines) from e
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
        if self._branch_from is not None and self.tier is not None:
            await self._retire_memory(self._branch_from, result.step)
        self._branch_from, self._abandons = None, []  # a new branch has committed its first step
        if abandons:  # the abandoned one goes now
            try:
                await self._io(branch.retire_superseded, self.store)
            except OSError as e:  # loads skip them; the next save or start removes them
                self._newest_seen.pop(self.store.url, None)  # their numbers are not free yet
                log.warning("could not yet remove the abandoned steps: %s", e)
        if self.tier is not None and store is self.tier.store:  # maybe persisted, later
            persist = (self._commit, self._retention)
            await self.tier.committed(manifest, self.store, persist, durable)
        else:
            await self._retention()
        return result

    async def _retire_memory(self, branch_from: int, new: int) -> None:
        """The memory steps of the abandoned branch go once the new branch has committed."""
        assert self.tier is not None
        try:
            for s in await self._io(layout.all_steps, self.tier.store):
                if s > branch_from and s != new:
                    await self._io(commit.remove_step, self.tier.store, s)
        except OSError as e:
            log.warning("could not yet remove the abandoned branch's memory steps: %s", e)

    async def _retention(self) -> None:
        """Best effort after a commit: a failure leaves extra steps, never a failed save (the
        step is committed); the next save tries again."""
        try:
            removed = await self._io(self._apply_retention)
        except OSError as e:
            self._newest_seen.pop(self.store.url, None)  # abandoned steps may be left
            log.warning("retention could not run (the next save tries again): %s", e)
            return
        if removed:
            log.info("retention removed steps %s", removed)

    def _apply_retention(self) -> list[int]:
        """Retention counts live steps only: an abandoned step not yet removed (its removal
        failed) must not push a step of the new branch out. The abandoned steps go first:
        the manifest that records their abandonment may be one retention removes, and then
        nothing would mark them abandoned any more."""
        branch.retire_superseded(self.store)
        live = layout.committed_steps(self.store)  # none abandoned is left
        return commit.apply_retention(self.store, self.config.retention, live)

    def _commit(self, manifest: layout.Manifest, store: Storage | None = None) -> None:
        """Commit under the lease (also the memory tier's persist: from its own thread)."""
        self._under_lease(self._commit_now, manifest, store)

    def _commit_now(self, manifest: layout.Manifest, store: Storage | None) -> None:
        with self._commit_lock:
            target = self.store if store is None else store
            commit.commit_step(target, manifest, self._lease.renew, self._signer)
            seen = self._newest_seen.get(target.url, 0)
            self._newest_seen[target.url] = max(seen, manifest.step)

    async def _persisted(
        self, units: list[Unit], result: SaveResult, start: float
    ) -> dict[tuple[str, int], list[FileRecord]]:
        """Poll every unit until its files are durable; a unit never blocks its actor meanwhile."""
        records: dict[tuple[str, int], list[FileRecord]] = {}
        delay = 0.002
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.save_timeout_s
        while len(records) < len(units):
            waiting = [u for u in units if (u.name, u.index) not in records]
            done = await self._all(waiting, lambda u: u.status(), result.step, "write")
            for u, recs in zip(waiting, done, strict=True):
                if recs is not None:
                    records[(u.name, u.index)] = recs
                    result.seconds[u.name] = time.perf_counter() - start
            if loop.time() > deadline:
                late = [u.label for u in units if (u.name, u.index) not in records]
                raise save_error(
                    self._newest(),
                    result.step,
                    [
                        f"{x}: still writing after {self.config.save_timeout_s:.0f}s "
                        "(CheckpointConfig.save_timeout_s)"
                        for x in late
                    ],
                )
            if len(records) < len(units):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.05)
        return records

    def _manifest(
        self, groups: dict[str, Group], step: int, records: dict, seconds: dict, extra: Any
    ) -> layout.Manifest:
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
            created=self._rt.wall(),
            generation=self._lease.generation,
        )

    async def _abort(
        self, units: list[Unit], step: int, error: BaseException, store: Storage
    ) -> None:
        """Stop every unit's part of a failed save (a trainer rank joins its background write,
        so the next save and load find it idle), then remove the step's files. Units that
        failed or hung are not asked: a hung actor would answer only after its hang."""
        failed: set[str] = getattr(error, "failed_units", set())
        units = [u for u in units if u.label not in failed]
        timeout = self.config.abort_timeout_s

        async def abort(u: Unit) -> None:  # the unit's call is made only once this runs
            await asyncio.wait_for(u.abort_save(timeout), timeout + 5)

        results = await asyncio.gather(*(abort(u) for u in units), return_exceptions=True)
        for u, r in zip(units, results, strict=True):
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                log.debug("abort of %s: %s", u.label, r)
        await self._discard(step, store)

    async def _discard(self, step: int, store: Storage) -> None:
        """Remove an aborted step's files; a failure here must not hide the save's own error.
        Never without the lease: the folder may be another job's by now (it removes them)."""
        if not self._lease.held:
            log.warning("not removing the aborted step %d: the lease is no longer held", step)
            return
        try:
            await self._io(commit.remove_if_uncommitted, store, step)
            if store is self.store and self._branch_from is not None:
                await self._put_back()
        except (OSError, CheckpointError) as e:
            log.warning(
                "could not remove aborted step %s (%s); it is not committed and will be "
                "removed at the next start",
                store.where(layout.step_name(step)),
                e,
            )

    async def _put_back(self) -> None:
        try:
            await self._io(branch.put_back, self.store, self._lease)
        except (OSError, CheckpointError) as e:  # the next start puts it back
            log.warning("could not put a set-aside step back yet: %s", e)

    async def wait(self, persisting: bool = True) -> SaveResult | None:
        """Wait for a background save (and, with the memory tier, its persist to the durable
        folder unless `persisting=False`); raises an error if one failed (never dropped)."""
        pending, self._pending = self._pending, None
        result = None if pending is None else await pending
        if persisting and self.tier is not None:
            await self.tier.flush()
        return result

    # ---- load ---------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending (the last one is the newest); steps of an abandoned
        branch whose removal is still pending are not listed."""
        return branch.live_steps(self.store)

    def _newest(self) -> int | None | OSError:
        """The newest committed step for error messages (the error if it cannot be listed)."""
        try:
            steps = self.steps()
            return steps[-1] if steps else None
        except OSError as e:
            return e

    async def load(
        self, step: int | None = None, exclude: Iterable[str] = (), allow_mismatch: bool = False
    ) -> LoadResult | None:
        """Restore the newest committed step (or `step`) into every registered component.

        Returns None on a folder without committed steps. `exclude` skips components by name;
        "optimizer" keeps the trainer's fresh optimizer (weights-only fine-tuning). With
        `fallback`, a damaged step is moved to `quarantine/` and the next older one loaded.
        Emits one `CheckpointEvent`."""
        started = time.perf_counter()
        try:
            loaded = await self._load(step, exclude, allow_mismatch)
        except BaseException as e:
            self._events.failed("load", step, "durable" if self.tier is None else "?", started, e)
            raise
        self._events.loaded(loaded, started)
        return loaded

    async def _load(
        self, step: int | None = None, exclude: Iterable[str] = (), allow_mismatch: bool = False
    ) -> LoadResult | None:
        """The load itself; `load` emits its event."""
        await self._settle()
        self._check_open()
        self._newest_seen.clear()
        if self.tier is not None:
            self.tier.relist()
        exclude = set(exclude)
        marked = await self._io(self._loadable)
        mem = await self._io(self.tier.steps) if self.tier is not None else []
        listed = max([*marked, *mem], default=None)
        if self.tier is not None:
            marked, mem = await self._io(self._live_across_tiers, marked, mem)
        if step is not None and step not in marked and step not in mem:
            raise CheckpointError(
                f"step {step} is not a committed step in {self.config.folder}; "
                f"committed steps: {self.steps() or 'none'}"
                + (f", in memory: {mem or 'none'}" if self.tier is not None else "")
            )
        candidates = load_candidates(mem, marked, step, self.config.fallback)
        # Read before anything is applied (a load is all or nothing): what a rollback to the
        # step loaded would abandon.
        oldest = min((c for _, c in candidates), default=None)
        newer = [] if oldest is None else await self._io(branch.abandoned_by, self.store, oldest)
        for n, (in_mem, candidate) in enumerate(candidates):
            try:
                loaded = await self._load_step(candidate, exclude, allow_mismatch, in_mem)
            except CheckpointCorruptError as e:
                if n + 1 == len(candidates):
                    raise
                nxt = candidates[n + 1]
                if in_mem:  # a lost copy never comes back: nothing to move aside
                    log.warning("%s; loading %s step %d", e, TIER[nxt[0]], nxt[1])
                    continue
                log.warning("step %d is corrupt (%s); falling back to %sstep %d", candidate, e,
                            "memory " if nxt[0] else "", nxt[1])  # fmt: skip
                await self._io(commit.quarantine_step, self.store, candidate)
                continue
            self._rollback_point(loaded.step, listed, newer)
            return loaded
        return None

    def _rollback_point(
        self, loaded: int, newest: int | None, newer: list[tuple[int, float]]
    ) -> None:
        """A load of an older step than the newest starts a branch at the next save: note
        the steps it will abandon (every newer one with a marker, recorded or not)."""
        self._branch_from = loaded if newest is not None and loaded < newest else None
        self._abandons = (
            [p for p in newer if p[0] > loaded] if self._branch_from is not None else []
        )

    def _live_across_tiers(self, marked: list[int], mem: list[int]) -> tuple[list, list]:
        """Less the steps of either tier that a committed step of the other abandoned."""
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

    def _loadable(self) -> list[int]:
        """Marked durable steps, less those a committed newer branch abandoned."""
        gone = branch.superseded(self.store)
        return [s for s in layout.marked_steps(self.store) if s not in gone]

    async def _settle(self) -> None:
        """Before a load: let a background save or persist end. Its failure is logged, not
        raised: a load chooses from what is committed, and recovery must not fail on it."""
        try:
            await self.wait(persisting=False)
        except Exception as e:
            log.warning("a background save failed before this load: %s", e)
        if self.tier is not None:
            failure = await self.tier.settle()
            if failure is not None:
                log.warning("%s; loading the newest whole step of either tier", failure)

    async def _load_step(
        self, step: int, exclude: set[str], allow_mismatch: bool, in_mem: bool = False
    ) -> LoadResult:
        store, spec = self._target(in_mem)
        if in_mem and self.tier is not None:  # every file must still have a copy somewhere
            await self._io(self.tier.check_whole, step)
        where = spec.child(layout.step_name(step))
        manifest = await self._io(layout.read_committed, store, step, self._signer)
        self._check_matches(manifest, exclude, allow_mismatch)
        verify = self.config.verify_on_load
        plan = await components.load_plan(self._groups, manifest, exclude, where, verify)
        units = [p[0] for p in plan]
        calls = [u.prepare(where, recs, verify, opts) for u, recs, opts in plan]
        try:
            notes = await self._all(units, None, step, "load", calls=calls)
        except BaseException:
            await asyncio.gather(*(u.abort() for u in units), return_exceptions=True)
            raise
        accepted = (f"{u.name}: {n}" for u, ns in zip(units, notes, strict=True) for n in ns)
        for line in dict.fromkeys(accepted):  # once per component, not per replica
            log.warning("loading despite a difference the component accepts: %s", line)
        await components.apply_all(units, step, self.config.load_timeout_s)
        log.info("loaded step %d from %s", step, where.url)
        return LoadResult(step, manifest.extra, where.url, manifest, TIER[in_mem])

    def _check_matches(self, manifest: layout.Manifest, exclude: set[str], allow: bool) -> None:
        """Raise CheckpointMismatchError listing every difference."""
        diffs = []
        fp = self.config.fingerprint
        if fp is not None and manifest.fingerprint is not None and fp != manifest.fingerprint:
            diffs.append(
                f"run fingerprint changed: checkpoint={manifest.fingerprint}, current={fp}"
                " (the folder holds another run's checkpoints)"
            )
        diffs += components.differences(self._groups, manifest, exclude)
        if diffs and not allow:
            raise CheckpointMismatchError(diffs)
        for d in diffs:
            log.warning("loading despite mismatch: %s", d)

    # ---- running calls on many units ------------------------------------------------------

    async def _all(
        self,
        units: list[Unit],
        call: Callable[[Unit], Awaitable] | None,
        step: int,
        phase: str,
        calls: Sequence[Awaitable] | None = None,
    ) -> list:
        """Run one call per unit at once (trainer ranks' calls are collectives: never in
        sequence); any failure becomes one error naming every failed unit."""
        knob = "load_timeout_s" if phase == "load" else "save_timeout_s"
        aws = calls if calls is not None else [call(u) for u in units]  # type: ignore[misc]
        labels = [u.label for u in units]
        return await gather_units(
            labels, aws, (getattr(self.config, knob), knob), phase, step, self._newest
        )

    # ---- lifetime -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed or self._close_requested:
            raise CheckpointError("this CheckpointCoordinator is closed")

    def close(self) -> None:
        """Release the folder's lease; never blocks. A background save that has not begun
        its commit is dropped (its files are removed at the next start); one whose commit is
        running keeps it, and the lease is released when that commit ends (a commit is never
        cut in half, and nothing is written after the release). Prefer `await aclose()`,
        which flushes a background save."""
        if self._pending is not None and not self._pending.done():
            log.warning("close() with a background save still running: it will not commit")
            self._pending.cancel()
        if self.tier is not None:
            self.tier.cancel()
        with self._state:
            if self._closed:
                return
            self._close_requested = True
            release = self._busy == 0
            self._closed = release
        if release:
            self._release()

    def _release(self) -> None:
        """The run is closed: its memory holders free their memory, then the lease goes. A
        job that lost the lease leaves them: they are its successor's now (same run)."""
        try:
            if self.tier is not None:
                if self._lease_is_ours():
                    self.tier.close()
                else:
                    self.tier.cancel()
        finally:
            self._lease.release()

    def _lease_is_ours(self) -> bool:
        """Renewed just now (the holders are killed within its TTL), or not ours (any more)."""
        try:
            self._lease.check(fresh=True)
            return True
        except (CheckpointError, OSError) as e:
            log.warning("leaving the memory holders to whoever holds the folder now: %s", e)
            return False

    def wipe(self) -> None:
        """Delete every step of the folder (each marker first) and the quarantined ones, then
        close: a run that starts over (`fresh`) under the same lease nobody else can hold."""
        try:
            for step in layout.all_steps(self.store):
                self._under_lease(commit.remove_step, self.store, step)
            self.store.delete_prefix(layout.QUARANTINE)
            self.store.delete_prefix(branch.ASIDE)
            if self.tier is not None:
                self.tier.wipe()
        finally:
            self.close()

    async def aclose(self) -> None:
        """Flush a background save (its error is raised), then release the lease."""
        try:
            await self.wait()
        finally:
            self.close()

    async def __aenter__(self) -> CheckpointCoordinator:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if exc[0] is None:
            await self.aclose()
        else:
            self.close()


def _log_background_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error(
            "background save failed (raised again by the next save() or wait()): %s",
            task.exception(),
        )


def _behind(store: Storage, durable: Storage) -> list[Storage]:
    """The stores whose newest step a save to `store` must not go behind: its own and, for a
    memory save, the durable folder too (else retention removes the older step persisted
    from memory by its number, and the next load resumes the newer one)."""
    return [store] if store is durable else [store, durable]


def _may_abort(committing: bool, e: BaseException) -> bool:
    """Whether a failed save may abort (remove its step): only before its commit began, or
    when the commit says it wrote no COMMIT. A cancellation or an error after that may have
    come after the step became visible: removing it would lose a committed step."""
    return not committing or getattr(e, "not_committed", False)
