"""The memory tier as the coordinator sees it: start or find this run's holders (one detached
actor per node, named after the run; `holders.py`), tell whether a memory step is still
whole, keep the newest memory steps (and every step still waiting to be persisted), and
persist a memory step to the durable folder from the holders' copies (the units are not
involved a second time). A persist's failure is kept until `flush()` raises it or
`settle()` hands it over: never dropped, whatever persists started since.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..coordination.events import CheckpointEvent, Events
from ..errors import CheckpointCorruptError, CheckpointError
from ..steps import branch, commit, layout
from ..storage import FileRecord, Storage, StorageSpec, open_storage
from .cluster import current
from .holder import NO_CLAIM
from .holders import Identity, alive_nodes, incarnation, run_id_of
from .placement import HolderRef
from .store import MemoryStorage

log = logging.getLogger("forge_ckpt")
NODES_EVERY_S = 2.0  # how often a save looks for nodes that joined (a GCS call)


def open_tier(
    config: Any,
    on_error: Callable[[], None],
    durable: Storage | None = None,
    to_thread: Callable[..., Awaitable[Any]] = asyncio.to_thread,
    confirm: Callable[[], None] | None = None,
) -> MemoryTier | None:
    """The memory tier when configured (`memory_every`); `on_error` (the lease's release)
    runs if it cannot start, so a failed coordinator never keeps the folder. `durable`: the
    folder (under the caller's lease), where the folder's incarnation id is kept;
    `to_thread`: where blocking calls run (the coordinator's Runtime); `confirm`: the
    folder lease's fresh check (`Identity`)."""
    if not config.memory_every:
        return None
    try:
        return MemoryTier(config, durable, to_thread, confirm)
    except BaseException:
        on_error()
        raise


class MemoryTier:
    def __init__(
        self,
        config: Any,
        durable: Storage | None = None,
        to_thread: Callable[..., Awaitable[Any]] = asyncio.to_thread,
        confirm: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.to_thread = to_thread  # the holders' calls (memory steps, pins)
        # The durable folder's calls of a persist: the coordinator's, under its lease (close()
        # releases it only after they end; a writer that lost it removes nothing).
        self.io: Callable[..., Awaitable[Any]] = to_thread
        self.run_id = run_id_of(config.folder)
        self.fingerprint = str(config.fingerprint or "")
        self.namespace = str(config.memory_namespace)
        durable = durable if durable is not None else open_storage(config.storage)
        self.identity = Identity(self.run_id, self.fingerprint, incarnation(durable),
                                 self.namespace, confirm)  # fmt: skip
        self._use(self._start_holders(alive_nodes()))
        self.saves = 0
        self._recent: list[int] | None = None  # memory steps for retention (None: list them)
        self._pinned: set[int] = set()  # due to be persisted, not yet: retention keeps them
        self._persisting: asyncio.Task | None = None
        self._stopped: set[asyncio.Task] = set()  # persists cancel() already cancelled
        self._chain: set[asyncio.Task] = set()  # every persist not yet ended (cancel() stops all)
        self._chain_steps: dict[asyncio.Task, int] = {}  # each one's step
        self._reaped: list[int] = []  # steps of persists a closed loop left: to unpin
        self._queued: asyncio.Task | None = None  # the persist waiting its turn (at most one)
        self._queued_before: asyncio.Task | None = None  # the one it waits for
        self._queued_step = -1  # its step
        self._supersede: asyncio.Future | None = None  # the queued one's: a newer step took
        # its turn
        self._closing = False  # cancel() was called: no persist starts after it
        self._failures: list[tuple[int, BaseException]] = []  # persists that failed, unraised
        self._checked_nodes: float | None = None  # the first save looks for new nodes
        self._events = Events(getattr(config, "on_event", None))
        commit.remove_uncommitted(self.store)  # a crashed driver's half-saved memory step

    def _use(self, holders: list[HolderRef]) -> None:
        """The storage spec the units get: it names the holders to place copies on."""
        options: dict[str, Any] = {
            "holders": tuple(holders),
            "copies": self.config.memory_copies,
            "namespace": self.namespace,
        }
        digest = self.config.storage.options.get("digest")
        if digest is not None:
            options["digest"] = digest
        if self.claim != NO_CLAIM:
            options["fence"] = (*self.claim, 0)
        self.spec = StorageSpec(f"mem://{self.run_id}", options)
        self.store: MemoryStorage = open_storage(self.spec)  # type: ignore[assignment]
        self.holders: list[HolderRef] = holders

    @property
    def claim(self) -> tuple[int, int]:
        """This opening of the folder: the holders refuse every other one's changes."""
        return self.identity.claim

    def attempt(self, number: int) -> tuple[MemoryStorage, StorageSpec]:
        """The storage and spec of one save attempt: what its units write and its commit
        carry the attempt's token (the step's files on the holders are that attempt's)."""
        if self.claim == NO_CLAIM:
            return self.store, self.spec
        spec = StorageSpec(self.spec.url, {**self.spec.options,
                                           "fence": (*self.claim, number)})  # fmt: skip
        return open_storage(spec), spec  # type: ignore[return-value]

    def add_new_nodes(self, every_s: float = NODES_EVERY_S) -> list[str]:
        """Start holders on nodes that joined since (a replacement for a lost node): at the
        first save, then at most every `every_s`; the next save places copies on them too.
        Their ids, if any."""
        now = current().monotonic()
        if self._checked_nodes is not None and now - self._checked_nodes < every_s:
            return []
        self._checked_nodes = now
        known = {node for _, node in self.holders}
        new = [n for n in alive_nodes() if n not in known]
        started = self._start_holders(new, joined=True) if new else []
        if started:
            self._use([*self.holders, *started])
            log.info("memory tier: holders started on new nodes %s",
                     [n[:8] for _, n in started])  # fmt: skip
        return [n for _, n in started]

    # ---- holders -----------------------------------------------------------------------
    def _start_holders(self, nodes: list[str], joined: bool = False) -> list[HolderRef]:
        cfg = self.config
        return self.identity.start(nodes, cfg.memory_budget_bytes, cfg.memory_keep, joined)

    def shutdown(self) -> None:
        """Kill this run's holders (their copies are gone): for a run that is over."""
        self.identity.release(self.holders)

    def close(self) -> None:
        """The run is closed: stop a persist in flight (its step stays uncommitted in the
        folder unless its commit had started) and release the holders' memory."""
        self.cancel()
        self.shutdown()

    def wipe(self) -> None:
        """Drop every memory step (marker first): a run that starts over."""
        for step in layout.all_steps(self.store):
            commit.remove_step(self.store, step)
        self._recent = None

    # ---- steps -------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Memory steps whose marker and manifest check out on some live holder."""
        return layout.committed_steps(self.store)

    def check_whole(self, step: int) -> None:
        """Raise CheckpointCorruptError naming each file that lost its last copy."""
        manifest = layout.read_committed(self.store, step)
        present = dict(self.store.walk(layout.step_name(step)))
        lost = []
        for name, comp in manifest.components.items():
            for f in comp.files:
                if present.get(f"{layout.step_name(step)}/{f.path}") != f.size:
                    lost.append(f"{name} {f.path}")
        if lost:
            alive = set(alive_nodes())
            dead = sorted({n[:8] for _, n in self.holders if n not in alive})
            raise CheckpointCorruptError(
                self.store.where(layout.step_name(step)),
                f"memory step {step} is gone: {', '.join(lost[:4])}"
                f"{' and more' if len(lost) > 4 else ''} lost the last copy "
                f"(nodes {dead or 'none'} died)",
                "An older step, in memory or durable, is loaded instead",
            )

    # ---- after a memory commit ---------------------------------------------------------
    async def committed(
        self,
        manifest: layout.Manifest,
        durable: Storage,
        persist: tuple[Callable[[layout.Manifest], None], Callable[[], Awaitable[None]]],
        due: bool | None = None,
    ) -> asyncio.Future | None:
        """Memory retention; the step also goes to the durable folder if `due` (default:
        every `durable_every`-th save), in the background (one persist at a time; `flush()`
        raises its error). `persist`: the coordinator's commit and durable retention.
        Returns the persist this step's waits for: the save waits for it too (backpressure:
        at most one persist waits behind the running one), outside this call, so that the
        next save, which waits for this call, does not wait for that persist too."""
        commit_fn, retention = persist
        step = manifest.step
        self.saves += 1
        due = self.saves % self.config.durable_every == 0 if due is None else due
        pinning: asyncio.Future | None = None
        turn: asyncio.Future | None = None
        if due:  # pinned before any retention: it stays in memory until persisted
            self._pinned.add(step)
        try:
            if due:
                pin = self.to_thread(self.store.fenced, "pin", step, True)
                pinning = asyncio.ensure_future(pin)  # its unpin must come after it lands
                await asyncio.shield(pinning)
            try:  # under the lease: a stale job's must not remove its successor's steps
                await self.io(self._retention, step)
            except (OSError, CheckpointError) as e:  # the step is committed: best effort
                self._recent = None  # (listed again by the next save's, which tries again)
                log.warning("memory retention could not run: %s", e)
            try:
                await self.to_thread(self.add_new_nodes)
            except Exception as e:  # the step is committed; the next save looks again
                log.warning("memory tier: could not look for new nodes: %s", e)
        except asyncio.CancelledError:  # the end of the event loop: a persist started now
            self.saves -= 1  # would fail; the coordinator runs this again on the next one
            due = False  # (review 7)
            raise
        finally:  # a pin that failed still leaves its step to a persist (it unpins it)
            if due:
                turn = self._start_persist(manifest, durable, commit_fn, retention, pinning)
        return turn

    def _start_persist(
        self,
        manifest: layout.Manifest,
        durable: Storage,
        commit_fn: Callable[[layout.Manifest], None],
        retention: Callable[[], Awaitable[None]],
        pinning: asyncio.Future | None = None,
    ) -> asyncio.Future | None:
        """The step's persist, after the one before it (returned). Started whatever happened
        to the save once the step was pinned: a pin no persist undoes kept the step due, and
        out of memory retention, for good (sim seed 1442: a save cancelled in its wait for
        the previous persist). Not after `cancel()` (close())."""
        if self._closing:
            return None
        before = self._persisting
        if self._queued is not None and not self._queued.done():
            # Coalesced: this newer step takes its turn (review 5). Told, not cancelled: a
            # task cancelled before it ever ran never unpins its step (review 6, A).
            if self._supersede is not None and not self._supersede.done():
                self._supersede.set_result(None)
            self._pinned.discard(self._queued_step)  # (its holders are unpinned by the task)
            before = self._queued_before
        superseded = self._supersede = asyncio.get_running_loop().create_future()
        turn = self._queued_turn(manifest, durable, commit_fn, retention,
                                 (before, pinning, superseded))  # fmt: skip
        task = self._persisting = asyncio.create_task(turn)
        self._queued, self._queued_before, self._queued_step = task, before, manifest.step
        self._chain.add(task)
        self._chain_steps[task] = manifest.step
        task.add_done_callback(self._ended)
        return before

    async def _queued_turn(
        self,
        manifest: layout.Manifest,
        durable: Storage,
        commit_fn: Callable[[layout.Manifest], None],
        retention: Callable[[], Awaitable[None]],
        waits_for: tuple[asyncio.Future | None, asyncio.Future | None, asyncio.Future],
    ) -> None:
        """Wait for the persist before and for the step's pin (its unpin must come after it
        lands), then persist; a newer due step that takes this turn (`superseded` is set)
        drops it instead."""
        before, pinning, superseded = waits_for
        try:
            while not superseded.done():
                waits = [f for f in (before, pinning) if f is not None and not f.done()]
                if not waits:
                    break
                await asyncio.wait([*waits, superseded], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await self._drop_queued(manifest.step, pinning)
            raise
        if superseded.done():
            await self._drop_queued(manifest.step, pinning)
            return
        if self._queued is asyncio.current_task():
            self._queued = None
        await self._persist_step(manifest, durable, commit_fn, retention)

    async def _drop_queued(self, step: int, pinning: asyncio.Future | None) -> None:
        """A persist cancelled before it began: a newer due step took its turn (at most one
        waits, however many saves a caller's deadline cut short), or close(). Its step is
        unpinned (after its pin landed), so memory retention may drop it again."""
        self._pinned.discard(step)
        if self._closing:
            return
        log.info("memory step %d is not persisted: a newer step is persisted instead", step)
        if pinning is not None and not pinning.done():
            await asyncio.wait([pinning])
        await self._unpin(step)

    async def _cut_off(self, step: int) -> None:
        """A persist cancelled by its event loop's end (an `asyncio.run()` that returned while
        it ran; a coordinator may serve several in turn): its step is unpinned on the
        holders, which would otherwise keep it for good. Not after close(): the holders may
        be a successor's, with a step of that number of its own pinned."""
        self._pinned.discard(step)
        log.warning("persisting memory step %d was cut off by the end of its event loop: it "
                    "may not be durable (the next durable save persists a newer one)", step)  # fmt: skip
        await self._unpin(step)

    async def _unpin(self, step: int) -> None:
        try:
            await self.to_thread(self.store.fenced, "pin", step, False)
        except Exception as e:  # a holder that is gone has no pin to drop
            log.debug("unpinning memory step %d: %s", step, e)

    async def _persist_step(
        self,
        manifest: layout.Manifest,
        durable: Storage,
        commit_fn: Callable[[layout.Manifest], None],
        retention: Callable[[], Awaitable[None]],
    ) -> None:
        """Persist, then the folder's retention; a failure is kept (and logged) for the next
        `flush()` / `settle()`; the step is unpinned either way."""
        step, started = manifest.step, time.perf_counter()
        done: bool | None = None  # the persist's outcome (its event), before the retention
        try:
            done = await self.persist(manifest, durable, self.config.storage, commit_fn)
            self._events.emit(CheckpointEvent("persist", step, "durable",
                                              "committed" if done else "skipped",
                                              nbytes=manifest.nbytes if done else 0,
                                              seconds=time.perf_counter() - started))  # fmt: skip
            await retention()
        except BaseException as error:
            if done is None:
                self._events.failed("persist", step, "durable", started, error, 0.0)
            if not isinstance(error, Exception):
                if not self._closing:  # not close(): its event loop ended (review 6, C)
                    await self._cut_off(step)
                raise
            e = error
            if not isinstance(e, CheckpointError):
                e = CheckpointError(
                    f"persisting memory step {step}: {type(error).__name__}: {error}. The step "
                    "is not durable (it may still be in memory); the next durable save "
                    "persists a newer one"
                )
                e.__cause__ = error
            self._failures.append((step, e))
            log.error("persisting memory step %d to the durable folder failed: %s (the next "
                      "wait() or aclose() raises it; load() logs it and loads the newest "
                      "whole step)", step, e)  # fmt: skip
        finally:
            self._pinned.discard(step)
        await self._unpin(step)

    def _retention(self, step: int) -> None:
        """Drop the memory steps beyond `memory_keep`, never one still waiting to be
        persisted (pinned). The steps are listed once; after that this tier's own commits
        are the list (a step lost with its holders is dropped again harmlessly), which saves
        a listing and two reads per step at every save. Two may overlap (a save cancelled by
        its caller's deadline leaves its thread running on): each works on its own list."""
        listed = self._recent if self._recent is not None else self.steps()
        recent = self._recent = sorted({*listed, step})
        keep = commit.RetentionPolicy(keep_last=self.config.memory_keep)
        gone = set()
        for old in keep.to_delete(recent):
            if old in self._pinned:
                continue
            commit.remove_step(self.store, old)
            gone.add(old)
        if self._recent is not None:  # (None: a load asked to list them again meanwhile)
            self._recent = [s for s in self._recent if s not in gone]

    def relist(self) -> None:
        """The steps changed other than by our commits (a load may retire a branch)."""
        self._recent = None

    async def settle(self) -> BaseException | None:
        """Wait for a persist in flight; the failure of every persist since the last call
        (one error naming each failed step), or None. For `load()`: it logs the failure and
        goes on to the newest whole step, where `flush()` would raise."""
        # Every persist, a dropped one's late unpin included: after a rollback, that unpin
        # would unpin a new step of the same number (review 6, B).
        while self._chain or self._persisting is not None:
            task = self._persisting
            if self._chain:  # cancelled here, the tasks stay for the next caller
                await asyncio.wait(set(self._chain))
            if self._persisting is task:  # (else a newer step took its turn meanwhile)
                self._persisting = None
        failures, self._failures = self._failures, []
        if not failures:
            return None
        if len(failures) == 1:
            return failures[0][1]
        err = CheckpointError(
            "persisting memory steps failed: "
            + "; ".join(f"step {s}: {e}" for s, e in failures)
            + ". Those steps are not durable; the next durable save persists a newer one"
        )
        err.__cause__ = failures[0][1]
        return err

    async def flush(self) -> None:
        """Wait for a persist in flight; raises the failure of any persist not yet raised."""
        failure = await self.settle()
        if failure is not None:
            raise failure

    @property
    def in_flight(self) -> list[asyncio.Task]:
        """The persists not yet ended."""
        return list(self._chain)

    def _ended(self, task: asyncio.Task) -> None:
        self._chain.discard(task)
        self._chain_steps.pop(task, None)

    def reap_closed(self) -> bool:
        """Persists of an event loop closed without ending them (no asyncio.run(): nothing
        cancelled them) never end: each is dropped, as a persist cut off by its loop's end
        is (its step may not be durable; `unpin_reaped` unpins it once the storage calls
        it left have ended). Whether any was (review 15, claim 2: load(), wait() and the
        next save waited for such a persist forever)."""
        dead = [t for t in self._chain if not t.done() and t.get_loop().is_closed()]
        for task in dead:
            self._reaped.append(self._chain_steps.pop(task))
            self._chain.discard(task)
            self._stopped.discard(task)
        if self._persisting in dead:
            self._persisting = None
        if self._queued in dead:
            self._queued, self._queued_before, self._queued_step = None, None, -1
        if self._supersede is not None and self._supersede.get_loop().is_closed():
            self._supersede = None
        return bool(dead)

    async def unpin_reaped(self) -> None:
        """Unpin the steps of the persists `reap_closed` dropped (after close(), the holders
        may be a successor's: `_cut_off` leaves them alone then)."""
        while self._reaped:
            step = self._reaped.pop(0)
            if not self._closing:
                await self._cut_off(step)

    def cancel(self) -> None:
        """Stop a persist in flight (close()): once, whoever asks again."""
        self.reap_closed()  # (a closed loop's task cannot be cancelled: it never runs again)
        self._closing = True
        live = [t for t in self._chain if not t.done() and t not in self._stopped]
        if live:
            log.warning("closing while persisting a memory step: it will not be durable")
        for task in live:
            task.cancel()
            self._stopped.add(task)

    # ---- persisting --------------------------------------------------------------------
    async def persist(
        self,
        manifest: layout.Manifest,
        durable: Storage,
        durable_spec: StorageSpec,
        commit_fn: Callable[[layout.Manifest], None],
    ) -> bool:
        """Copy a committed memory step to the durable folder (each holder writes the files
        it holds), then commit it there with the same manifest (False: it was already). A
        failure (or cancel) before the commit removes the step's files; once the commit was called they stay, whatever
        happens: it may have committed (a cancelled task's thread goes on), and a step
        without COMMIT is removed by the next start (or the next persist of that step)."""
        step, name = manifest.step, layout.step_name(manifest.step)
        if step in await self.io(branch.live_steps, durable):
            return False
        if step in await self.io(branch.superseded, durable):  # an abandoned one: its
            await self.io(commit.remove_step, durable, step)  # number is free
        await self.io(commit.prepare_step, durable, step)
        try:
            written = await self._holders_write(manifest, durable_spec.child(name))
            want = {f.path: f for f in manifest.files}
            for rec in written:
                exp = want.pop(rec.path)
                if (rec.size, rec.crc32c) != (exp.size, exp.crc32c):
                    raise CheckpointCorruptError(durable.where(f"{name}/{rec.path}"),
                                                 "persisted copy differs from the manifest")  # fmt: skip
            if want:
                raise CheckpointError(f"persisting step {step}: not written: {sorted(want)}")
        except GeneratorExit:  # closed unrun by a dropped loop: nothing can be awaited
            raise
        except BaseException:
            await self.io(commit.remove_step, durable, step)
            raise
        await self.io(commit_fn, manifest)  # from here on, nothing is removed
        log.info("persisted memory step %d to %s", step, durable.where(name))
        return True

    async def _holders_write(self, manifest: layout.Manifest, spec: StorageSpec) -> list:
        """Each file is written by one live holder that has it, holders in parallel."""
        prefix = layout.step_name(manifest.step)
        keys = [f"{prefix}/{f.path}" for f in manifest.files]
        # copies that match the manifest: a stale job's late write may have left another
        # file of the name on a holder that had none (review 21)
        records = [(f.size, f.crc32c) for f in manifest.files]
        has = await self.to_thread(self.store.holding, keys, records)
        jobs: dict[HolderRef, list[tuple[str, str]]] = {}
        for i, (f, key) in enumerate(zip(manifest.files, keys, strict=True)):
            owner = next((ref for ref, flags in has if flags[i]), None)
            if owner is None:
                raise CheckpointError(
                    f"persisting step {manifest.step}: {key} has no copy left that matches "
                    "the manifest"
                )
            jobs.setdefault(owner, []).append((key, f.path))
        calls = [self.store.handle(ref[0]).persist.remote(spec, job) for ref, job in jobs.items()]
        results = await asyncio.gather(*calls)
        return [FileRecord.from_dict(r) for rs in results for r in rs]
