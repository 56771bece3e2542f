"""What a commit sets going, as tasks of their own, and the commits whose follow-up was cut off.

After a step commits, the coordinator retires an abandoned branch, pins the memory step and
starts its persist, and runs retention (`Committer.follow_up`, committer.py). That
work runs as a task the next save, load and `wait()` wait for, so that a save cancelled in or
after its commit still leaves its step pinned and persisted, where a retry is told "already
committed" (review 5, claim 5). A follow-up cut off (the end of an event loop cancels its task)
or a commit of unknown outcome is recorded as owed: the next save, load or `wait()` reads
whether that commit landed and, if it did, runs its follow-up then (review 7).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointSaveError
from ..steps import layout, lock
from ..storage import Storage

log = logging.getLogger("forge_ckpt")

Abandons = list[tuple[int, float]]
Owed = tuple[layout.Manifest, Storage, Abandons, "bool | None"]
Work = Callable[[layout.Manifest, Storage, Abandons, "bool | None"], Awaitable[Any]]


class FollowUps:
    """The follow-up tasks of one coordinator, and its owed follow-ups."""

    def __init__(
        self,
        work: Work,
        io: Callable[..., Awaitable[Any]],
        running: set[asyncio.Future],
        committed: Callable[[Storage, int], None],
    ) -> None:
        """`work`: the follow-up itself; `io`: a storage call under the lease; `running`: the
        coordinator's calls a save or load waits for (a follow-up is one of them);
        `committed`: tells the timeline of a commit found to have landed."""
        self._work, self._io, self._running, self._committed = work, io, running, committed
        self.tasks: set[asyncio.Future] = set()
        self.owed: list[Owed] = []
        # One per entry a caller took and holds (None once its follow-up task took it over).
        self._taken: dict[asyncio.Future, Owed | None] = {}
        self._of: dict[asyncio.Future, Owed] = {}  # each follow-up task: what it follows
        self.unsure: list[Owed] = []  # dropped by a deciding load that could not look
        self.look_error: Exception | None = None  # why the last look could not tell

    def start(
        self,
        commit_call: asyncio.Future,
        manifest: layout.Manifest,
        store: Storage,
        abandons: Abandons,
        durable: bool | None,
    ) -> asyncio.Task:
        """The follow-up of `commit_call` (a storage call), once it returns."""
        owed = (manifest, store, abandons, durable)
        task = asyncio.ensure_future(self._after(commit_call, owed))
        self._of[task] = owed
        task.add_done_callback(lambda t: self._of.pop(t, None))
        for tasks in (self._running, self.tasks):
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        return task

    def reap_closed(self) -> int:
        """Follow-ups, and the coordinator's calls, of an event loop closed without ending
        them (no asyncio.run(): nothing cancelled them) never end: they are dropped, and
        each follow-up is owed instead (review 11, claim 5), as is an entry a caller of that
        loop held while it looked (review 12, claim 3). Returns how many calls were dropped:
        their threads may still run (the caller waits for them: review 12, claim 2)."""
        dropped = [f for f in self._running if not f.done() and f.get_loop().is_closed()]
        for fut in dropped:
            self._running.discard(fut)
            self.tasks.discard(fut)
            owed = self._of.pop(fut, None)
            if owed is not None:
                self.owed.append(owed)
        for held, entry in list(self._taken.items()):
            if held.get_loop().is_closed():
                del self._taken[held]
                if entry is not None and not any(o is entry for o in self.owed):
                    self.owed.insert(0, entry)
        return len(dropped)

    async def _after(self, commit_call: asyncio.Future, owed: Owed) -> Any:
        """The work's result (the persist a due memory step's waits for), or None."""
        try:
            await commit_call
        except asyncio.CancelledError:  # the end of the event loop (nothing else cancels
            self.owed.append(owed)  # this task); the commit's thread runs on (review 7)
            raise
        except BaseException as e:  # the save reports it (or its caller is gone)
            if not isinstance(e, CheckpointError) or isinstance(e, OSError):
                self.owed.append(owed)  # outcome unknown: the next save or load looks
            return None
        try:
            return await self._work(*owed)
        except asyncio.CancelledError:  # (idem): the next save, load or wait() runs it
            self.owed.append(owed)
            raise

    async def run_owed(self, decide: bool) -> None:
        """The follow-up of each owed commit that landed. One that cannot be checked waits
        for the next call, unless `decide` (a load, which decides from what it reads: run
        after it, a rollback's would be undone; review 8). A deciding caller also waits for
        the entries other callers hold, and decides those they put back (review 10, B)."""
        while True:
            while self.owed:
                if not await self._run_one(decide):
                    return
            held = [f for f in self._taken if not f.done()]
            if not decide or not held:
                return
            await self._await_held(held)

    async def _await_held(self, held: list[asyncio.Future]) -> None:
        """Until the callers that hold `held` are done with their entries."""
        await asyncio.wait(held)

    async def _run_one(self, decide: bool) -> bool:
        """Take the first owed entry and settle it; False if it was put back (the caller
        stops: it could not tell, and does not decide)."""
        entry = self.owed.pop(0)  # taken: a caller beside this one takes the next (review 9)
        held: asyncio.Future = asyncio.get_running_loop().create_future()
        self._taken[held] = entry
        try:
            return await self._settle(entry, decide, held)
        finally:  # after the entry went back, if it did: a deciding caller looks again
            held.set_result(None)
            self._taken.pop(held, None)

    async def _settle(self, entry: Owed, decide: bool, held: asyncio.Future) -> bool:
        manifest, store, abandons, durable = entry
        try:
            # The lease's own record may hold the step while the folder's may not (a record
            # write of unknown outcome, which a later renewal would land): written first,
            # so that what is read is what stays (review 10 G, review 11).
            await self._io(settle_record, store)
        except asyncio.CancelledError:
            self.owed.insert(0, entry)
            raise
        except Exception as e:
            if not decide:
                return self._undecided(entry, decide, e)
            self.owed.insert(0, entry)  # a load cannot decide while that write fails: it
            raise CheckpointError(  # fails, and the next one looks again (review 12)
                f"cannot tell whether step {manifest.step} committed: writing the folder's "
                f"lease (its commit record) failed: {e}; retry the load"
            ) from e
        try:
            landed = await self._io(committed_as, store, manifest)
        except asyncio.CancelledError:  # the caller's deadline, or its loop's end, while it
            self.owed.insert(0, entry)  # looked: the entry stays owed (review 10, A)
            raise
        except Exception as e:
            return self._undecided(entry, decide, e)
        if not landed:
            return True
        self._taken[held] = None  # its follow-up task (`_of`) answers for it from here
        await self._follow(entry)
        return True

    async def _follow(self, entry: Owed) -> None:
        """Run the follow-up of `entry`, whose commit landed."""
        manifest, store, abandons, durable = entry
        log.info("step %d was committed: running what its commit sets going", manifest.step)
        self._committed(store, manifest.step)
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        done.set_result(None)
        try:
            await asyncio.shield(self.start(done, manifest, store, abandons, durable))
        except Exception as e:  # the step is committed: its follow-up is best effort
            log.warning("after committing step %d: %s", manifest.step, e)

    async def loaded(self, manifest: layout.Manifest, url: str, rollback: bool) -> None:
        """A deciding load that dropped entries it could not look at has loaded `manifest`
        from `url`: if one of them is that very commit, it landed after all, and the job goes
        on from it: its follow-up runs (pinned, persisted when due; review 11, claim 8),
        unless the load rolled back to it (a follow-up clears the branch the rollback set:
        review 13, claim 1). The others stay dropped: the load chose without them."""
        unsure, self.unsure = self.unsure, []
        for entry in [] if rollback else unsure:
            same = (entry[0].step, entry[0].created, entry[1].url)
            if same == (manifest.step, manifest.created, url):
                await self._follow(entry)

    def load_failed(self) -> None:
        """A load that failed or was cancelled decided nothing: the entries it could not
        look at are owed again (review 13, claims 2 and 3: one left aside undid a later
        rollback, or its landed step was never persisted)."""
        self.owed[0:0], self.unsure = self.unsure, []

    def refuse_owed(self, step: int) -> None:
        """Before a save of `step`: an owed commit of that very number whose outcome could not
        be read means the save cannot tell whether the step exists (a retry after a lost reply
        would be told "save a different step number" after a rollback; review 10, H). It
        refuses, naming why, and the next save of `step` looks again."""
        if any(entry[0].step == step for entry in self.owed):
            raise CheckpointSaveError(
                f"cannot tell yet whether the earlier save of step {step} committed (its "
                f"reply was lost, and reading its commit failed: {self.look_error}); nothing "
                f"was written for this save; retry save({step}), which reads it again"
            )

    def _undecided(self, entry: Owed, decide: bool, error: Exception) -> bool:
        """A look that failed: the entry waits for the next call (False), or, for a load,
        is dropped (a load decides from what it can read: review 8)."""
        self.look_error = error
        log.warning("could not tell whether step %d committed: %s%s", entry[0].step, error,
                    "" if decide else " (the next save, load or wait() looks again)")  # fmt: skip
        if not decide:
            self.owed.insert(0, entry)
            return False
        self.unsure.append(entry)  # the load may yet find it landed (`loaded`)
        return True


def settle_record(store: Storage) -> None:
    """The caller's lease on `store` writes its commit record if the folder's may differ
    (nothing for a store without a lease of its own: the memory tier's COMMIT is its commit)."""
    lease = lock.lease_of(store)
    if lease is not None:
        lease.settle_record()


def committed_as(store: Storage, manifest: layout.Manifest) -> bool:
    """Whether `manifest`'s step is committed in `store`, by that very commit."""
    try:
        return layout.read_committed(store, manifest.step).created == manifest.created
    except CheckpointCorruptError:
        return False


def log_failure(step: int) -> Callable[[asyncio.Future], None]:
    """The follow-up of a save whose caller is gone: its error is logged."""

    def done(follow: asyncio.Future) -> None:
        if not follow.cancelled() and follow.exception() is not None:
            log.error("after committing step %d: %s", step, follow.exception())

    return done
