"""`CheckpointCoordinator`: saves the trainer and every registered actor as one atomic step.

Reads top to bottom: opening the folder (lease, crash leftovers), registration, save
(snapshot phase, persist phase, commit, retention; abort on failure), load, and lifetime.
Its collaborators each hold one part: `Timeline` (timeline.py) which step numbers a save may
take and which it abandons after a rollback, `Loader` (loader.py) the all-or-nothing load,
`Committer` (committer.py) the manifest, the commit and what it sets going, and an aborted
save's removal, `LeasedCalls` (leased_calls.py) storage calls under the lease and a close that
never cuts one, unit_calls.py the calls on many actors at once. The protocol's rules and the invariants the
simulation (forge_ckpt.sim) checks are in docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any

from ..actors.reshard import ReshardRule
from ..config import CheckpointConfig
from ..errors import CheckpointError, CheckpointSaveError
from ..memory.choose import TIER
from ..memory.tier import open_tier
from ..steps import branch, commit, layout
from ..steps.lock import Lease
from ..storage import Storage, StorageSpec, open_storage
from . import unit_calls
from .committer import Committer
from .components import Group, Unit, actor_group, trainer_group
from .events import Events
from .leased_calls import LeasedCalls
from .loader import Loader
from .remote_errors import describe, save_error
from .results import LoadResult, SaveResult
from .runtime import DEFAULT, Runtime
from .storage_calls import StorageCalls, refuse_loop, refuse_open_elsewhere
from .timeline import Timeline

log = logging.getLogger("forge_ckpt")


class CheckpointCoordinator:
    """Orchestrates save and load of one RL job; the only writer of its checkpoint folder."""

    def __init__(self, config: CheckpointConfig, *, runtime: Runtime = DEFAULT) -> None:
        """`runtime`: threads and clocks (forge_ckpt.sim passes its deterministic ones)."""
        self.config = config
        self._rt = runtime
        self.store = open_storage(config.storage)
        self._signer = config.signer
        self._lease = Lease(
            self.store,
            config.lease_ttl_s,
            clock=runtime.wall,
            renew_in_background=runtime.lease_thread,
            identity=runtime.identity,
            lock=runtime.lock,
            clock_skew_s=config.max_clock_skew_s,
        )
        self._calls = LeasedCalls(self._lease, self._release)  # close() never cuts one
        self._storage = StorageCalls(
            self._calls, runtime.to_thread, lambda: self.config.save_timeout_s
        )
        self._running = self._storage.running  # storage calls in their threads
        self._io = self._storage.io
        self._under_lease = self._calls.run
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
        self._pending_step = -1  # its step
        self._attempts = 0  # save attempts so far (they name their files)
        self._op_lock: tuple[Any, asyncio.Lock] | None = None  # (its loop, the lock): _op()
        self._events = Events(config.on_event)  # one record per save and load (events.py)
        # None: no memory tier. Its holders are claimed under the lease (`Lease.check`: held,
        # not freshly renewed: a claim is a compare and set over the claim seen, which a late
        # one fails if another opening claimed since).
        self.tier = open_tier(config, self._lease.release, self.store, runtime.to_thread,
                              self._lease.check)  # fmt: skip
        if self.tier is not None:
            self.tier.io = self._storage.background
        memory = self.tier.store if self.tier is not None else None
        self._timeline = Timeline(self.store, config, memory)
        self._committer = Committer(config, self.store, self.tier, self._timeline, self._lease,
                                    self._storage, self._newest, runtime)  # fmt: skip
        self._follow_ups = self._committer.follow_ups
        self._loader = Loader(config, self._signer, self.store, self.tier, self._timeline,
                              self._groups, self._io, self._newest)  # fmt: skip

    async def _confirm_lease(self, step: int) -> None:
        """The lease check of a save whose step is already committed; a storage error there
        says so, not "nothing was committed" (review 5)."""
        try:
            await self._io(self._lease.check)
        except OSError as e:
            raise CheckpointSaveError(
                f"step {step} is already committed in {self.config.folder}, but this job "
                f"could not confirm it still holds the folder's lease ({e}); retry the save"
            ) from e

    def _op(self) -> asyncio.Lock:
        """One save or load at a time (a load changes the branch a save acts on). One lock per
        event loop: a coordinator may serve several `asyncio.run()` calls in turn; a save or
        load still under way in another loop that is open (left idle mid-save) is refused:
        resumed later, its commit would land over this loop's (review 16)."""
        loop = asyncio.get_running_loop()
        if self._op_lock is None or self._op_lock[0] is not loop:
            if self._op_lock is not None and self._op_lock[1].locked():
                refuse_loop(self._op_lock[0])
            self._op_lock = (loop, asyncio.Lock())
        return self._op_lock[1]

    async def _quiesce_calls(self, every: bool = True, decide: bool = False) -> None:
        """What a cancelled save's commit set going (`_follow`) has ended and, if `every`
        (a save or load), every storage call a cancelled save or load left running; then a
        commit whose follow-up was cut off has it (follow_ups.py)."""
        self._storage.look(self._elsewhere())
        reaped = self.tier is not None and self.tier.reap_closed()
        if self._follow_ups.reap_closed() or reaped:
            self._storage.orphans = True
        while pending := (self._running if every else self._follow_ups.tasks):
            await asyncio.wait(set(pending))
        # A closed loop's storage call may still run: what it leaves (a COMMIT, say) must be
        # there before anyone looks.
        await self._storage.await_orphans()
        if self.tier is not None:
            await self.tier.unpin_reaped()
        await self._follow_ups.run_owed(decide)

    def _elsewhere(self) -> list[asyncio.Future]:
        """What else of this coordinator may be under way in an event loop of its own."""
        persists = self.tier.in_flight if self.tier is not None else []
        return [*self._follow_ups.tasks, *persists]

    async def _quiesce(self, decide: bool = False) -> None:
        """Before a save or a load: the storage calls of a cancelled one have ended, and a
        set-aside it left behind (a rollback's save cancelled mid-move) is put back. A load
        decides every owed follow-up (`decide`, review 10, B)."""
        await self._quiesce_calls(decide=decide)
        if self._timeline.aside:
            await self._committer.put_back()

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
        `reshard_states`, if any; see forge_ckpt.actors.reshard); `optional=True` lets a checkpoint
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
            async with self._op():
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
        self._calls.check_open()
        await self._quiesce()
        self._follow_ups.refuse_owed(step)
        # A new branch's first step goes to the durable folder, whose manifests record what
        # it abandons (in both tiers): a memory step can record nothing that outlives it.
        self._attempts += 1  # each attempt's files are its own (layout.actor_file)
        attempt = layout.attempt_name(self._lease.generation, self._attempts)
        memory = self.tier is not None and self._timeline.branch_from is None
        store, spec = self._target(memory, self._attempts)
        where = spec.child(layout.step_name(step))
        mode = self.config.async_mode
        background = defer = mode != "sync"  # a config's "async" is mapped to "deferred"
        start = time.perf_counter()
        prepared = False  # only a folder this save prepared is ever removed by its abort
        try:
            plan = await self._io(self._timeline.plan, step, store)
            if plan is None:  # already committed: by this job, unless it was taken over
                await self._confirm_lease(step)  # (then its successor's: sim seed 10363)
                return SaveResult(step, where.url, committed=True)
            prepared = True
            await self._io(commit.prepare_step, store, step)
        except OSError as e:
            if prepared:
                await self._committer.discard(step, store)
            elif self._timeline.branch_from is not None and store is self.store:
                await self._committer.put_back()  # a set-aside move that failed half-way
            lines = [f"preparing the step: {describe(e)}"]
            raise save_error(self._newest(), step, lines) from e
        groups = dict(self._groups)  # what this save holds, whatever register() does meanwhile
        units = [u for g in groups.values() for u in g.units]
        calls = [u.begin(where, background, defer, attempt) for u in units]  # the cut
        begun = self._snapshots(units, calls, step, store)
        result = SaveResult(step, where.url)
        if not defer:
            result.nbytes = await begun
        result.blocked_s = time.perf_counter() - start
        finish = self._committer.finish(
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
        self._pending_step = step
        return result

    async def _snapshots(
        self, units: list[Unit], calls: list[Awaitable], step: int, store: Storage
    ) -> int:
        """The snapshots' total size (their calls are already submitted); a failure aborts."""
        try:
            args = (step, "snapshot", self.config, self._newest)
            return sum(await unit_calls.run_all(units, calls, *args))
        except GeneratorExit:  # closed unrun by a dropped loop: nothing can be awaited
            raise
        except BaseException as e:
            await self._committer.abort(units, step, e, store)
            raise

    def _target(self, memory: bool, attempt: int) -> tuple[Storage, StorageSpec]:
        """The memory tier's storage (that of save `attempt`) or the durable folder's."""
        if memory and self.tier is not None:
            return self.tier.attempt(attempt)
        return self.store, self.config.storage

    async def wait(self, persisting: bool = True) -> SaveResult | None:
        """Wait for a background save (and, with the memory tier, its persist to the durable
        folder unless `persisting=False`); raises an error if one failed (never dropped)."""
        pending, result, cut = self._pending, None, False
        failure: Exception | None = None
        refuse_open_elsewhere([pending] if pending is not None else [])
        if pending is not None and not pending.done() and pending.get_loop().is_closed():
            failure, cut = self._cut_off_error(), True  # its loop closed under it (review 10, F)
        elif pending is not None:
            # Shielded: a caller's deadline on this wait (or on the save or load it is part
            # of) must not cancel the background save; the next wait() still sees its end.
            try:
                result = await asyncio.shield(pending)
            except asyncio.CancelledError:
                if not pending.cancelled() or _cancelling():
                    raise  # the caller's own cancellation (the next wait() sees the end)
                failure, cut = self._cut_off_error(), True  # close(), or its loop's end
            except Exception as e:  # raised below, once what is owed has run (review 10, C)
                failure = e
            except BaseException:
                self._pending = None
                raise
        # `_pending` stays until its outcome is raised or returned: a caller cancelled in
        # what follows leaves it to the next wait() (review 11, claim 6).
        if persisting:  # what a cancelled save's commit set going (retention, a persist)
            await self._quiesce_calls(every=False)
        if persisting and self.tier is not None and not cut:
            await self._flush(failure)  # (a cut-off save's persists were cut off with it)
        self._pending = None
        if failure is not None:
            raise failure
        return result

    async def _flush(self, failure: Exception | None) -> None:
        """The persists the memory tier has under way. Beside a failed save's error (raised
        after this), a persist's failure is logged: a commit that landed was persisted."""
        assert self.tier is not None
        try:
            await self.tier.flush()
        except Exception as e:
            if failure is None:
                raise
            log.warning("after the failed save: %s", e)

    def _cut_off_error(self) -> CheckpointSaveError:
        return CheckpointSaveError(
            f"the background save of step {self._pending_step} was cancelled (close(), or the "
            "end of its event loop) before it ended: it is committed only if its commit ran "
            "(then what that commit sets going has run by now, or runs at the next save or "
            "load); its files are removed at the next start otherwise (review 8)"
        )

    # ---- load ---------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending (the last one is the newest); steps of an abandoned
        branch whose removal is still pending are not listed."""
        return self._timeline.steps()

    def _newest(self) -> int | None | OSError:
        """The newest committed step of either tier, for error messages (the error if they
        cannot be listed)."""
        try:
            steps = self.steps() + (self.tier.steps() if self.tier is not None else [])
            return max(steps, default=None)
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
            async with self._op():
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
        try:
            await self._settle()
            self._calls.check_open()
            # Every call this coordinator waits for has ended, and the persists are settled:
            # a call still running was cut off from its caller (a persist's COMMIT whose task
            # was cancelled, review 14 claim 1). The load waits for it before it looks.
            self._storage.suspect_running()
            await self._quiesce(decide=True)
            self._timeline.forget()
            if self.tier is not None:
                await self._committer.retire_memory()
                self.tier.relist()
            loaded = await self._loader.load(step, set(exclude), allow_mismatch)
        except BaseException:
            self._follow_ups.load_failed()
            raise
        if loaded is None:
            self._follow_ups.unsure.clear()
            return None
        tier = self.tier.store if loaded.tier == "memory" and self.tier else self.store
        rollback = self._timeline.branch_from is not None
        await self._follow_ups.loaded(loaded.manifest, tier.url, rollback)
        return loaded

    async def _settle(self) -> None:
        """Before a load: let a background save or persist end. Its failure is logged, not
        raised: a load chooses from what is committed, and recovery must not fail on it."""
        try:
            await self.wait(persisting=False)
        except Exception as e:
            log.warning("a background save failed before this load: %s", e)
        # What a cancelled save's commit set going may start a persist (review 7); an owed
        # follow-up is decided here, before the tier settles and the load chooses (review 8).
        await self._quiesce_calls(decide=True)
        if self.tier is not None:
            failure = await self.tier.settle()
            if failure is not None:
                log.warning("%s; loading the newest whole step of either tier", failure)

    # ---- lifetime -----------------------------------------------------------------------

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
        self._calls.close()

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
        """Renewed less than half a TTL ago, as far as this job knows without a storage call
        (close() never blocks): the holders are killed long before its expiry. Otherwise the
        folder may be another job's by now, and so are the run's holders: they stay."""
        if self._lease.renewed_within(self._lease.ttl_s / 2):
            return True
        log.warning("leaving the memory holders alive: this job's lease was not renewed "
                    "recently, and the folder (and its holders) may be another job's now")  # fmt: skip
        return False

    def wipe(self) -> None:
        """Delete every step of the folder (each marker first) and the quarantined ones, then
        close: a run that starts over (`fresh`) under the same lease nobody else can hold."""
        try:
            for step in layout.all_steps(self.store):
                self._under_lease(commit.remove_step, self.store, step)
            self._under_lease(self.store.delete_prefix, layout.QUARANTINE)
            self._under_lease(self.store.delete_prefix, branch.ASIDE)
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


def _cancelling() -> bool:
    """Whether the current task is being cancelled (Python 3.11+; False before)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False
