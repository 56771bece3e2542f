"""The step numbers of one job's folder: which a save may take, which it abandons after a
rollback, which a load may choose, which retention removes.

Step numbers only grow along a timeline, so the newest step is also the highest number, with
one exception: after `load(step=K)` with newer steps in the folder (a rollback), the next save
starts a new branch whose manifest names the steps it abandons (branch.py). Every method that
lists storage blocks: the coordinator calls it off the event loop, under its lease.
"""

from __future__ import annotations

import logging

from ..config import CheckpointConfig
from ..errors import CheckpointSaveError
from ..steps import branch, commit, layout
from ..storage import Storage

log = logging.getLogger("forge_ckpt")

Abandoned = list[tuple[int, float]]  # (step, its manifest's creation time)


class Timeline:
    """The rules over one folder's step numbers (and its memory tier's, if any)."""

    def __init__(self, store: Storage, config: CheckpointConfig, memory: Storage | None) -> None:
        self.store, self.config, self.memory = store, config, memory
        self.branch_from: int | None = None  # set by a load of an older step (rollback)
        self.abandons: Abandoned = []  # what that load found newer (in either tier)
        self.aside = False  # a step was set aside and may need putting back (branch.py)
        # store url -> a step no newer than which anything is committed there (the job is
        # the only writer): a save of a newer step skips listing the steps before its cut.
        self._newest_seen: dict[str, int] = {}

    def steps(self) -> list[int]:
        """Committed steps, ascending, less the abandoned ones whose removal is pending."""
        return branch.live_steps(self.store)

    def plan(self, step: int, store: Storage) -> Abandoned | None:
        """Before a save of `step` to `store`: None if it is already committed; else the
        steps this save abandons (after a rollback). Refuses a step older than the newest of
        either tier. A step of the abandoned branch with this very number is set aside first."""
        if self.branch_from is not None and step > self.branch_from:
            # What the rollback saw, not what is there now: a step of this new branch whose
            # commit's outcome was unknown is newer than the branch point too.
            abandons = list(self.abandons)
            old = {t for s, t in abandons if s == step}  # a durable copy, a memory one
            if any(branch.is_present(self.store, step, t) for t in old):
                log.warning("rollback: setting step %d of the abandoned branch aside", step)
                self.aside = True
                branch.set_aside(self.store, step)
            return abandons  # the abandoned memory steps stay till the commit: they may be
            # the only copies (durable_every > 1)
        if step > self._newest_seen.get(store.url, step):
            return []
        newest, gone = 0, set[int]()
        for s in _behind(store, self.store):
            found = branch.committed_manifests(s)  # read once for both questions
            abandoned = branch.superseded(s, found)
            committed = [x for x in found if x not in abandoned]
            if s is store and step in committed:
                log.warning("step %d is already committed; nothing to save", step)
                return None
            newest = max(newest, committed[-1] if committed else 0)
            if s is self.store:
                gone = abandoned
        self._newest_seen[store.url] = newest
        if store is self.store and step in gone:
            commit.remove_step(store, step)  # abandoned by a committed branch: free number
        if step < newest:
            raise CheckpointSaveError(
                f"cannot save step {step}: step {newest} is newer in {self.config.folder}. To "
                "branch from an older step, load(step=...) it first (the newer steps are then "
                "retired once the first save of the new branch commits)"
            )
        return []

    def committed(self, store: Storage, step: int) -> None:
        """`step` was committed to `store` (by this job, the folder's only writer)."""
        self._newest_seen[store.url] = max(self._newest_seen.get(store.url, 0), step)

    def forget(self, store: Storage | None = None) -> None:
        """Stop trusting what was seen of `store` (of every store if None): a removal failed
        (its numbers are not free yet) or a load changes the branch."""
        if store is None:
            self._newest_seen.clear()
        else:
            self._newest_seen.pop(store.url, None)

    def branch_at(self, loaded: int, newest: int | None, newer: Abandoned) -> None:
        """A load of `loaded` when `newest` is the newest step of either tier: a load of an
        older step starts a branch at the next save, which abandons every newer step with a
        marker (`newer`, read before anything was applied), recorded or not."""
        self.branch_from = loaded if newest is not None and loaded < newest else None
        self.abandons = [p for p in newer if p[0] > loaded] if self.branch_from is not None else []

    def branch_committed(self) -> None:
        """The new branch committed its first step: steps go by number again."""
        self.branch_from, self.abandons, self.aside = None, [], False

    def apply_retention(self) -> list[int]:
        """Retention counts live steps only: an abandoned step not yet removed (its removal
        failed) must not push a step of the new branch out. The abandoned steps go first:
        the manifest that records their abandonment may be one retention removes, and then
        nothing would mark them abandoned any more."""
        found = branch.committed_manifests(self.store)  # one read: we are its only writer
        gone = branch.retire_superseded(self.store, found)
        live = [s for s in found if s not in gone]
        return commit.apply_retention(self.store, self.config.retention, live)

    def loadable(self) -> list[int]:
        """Marked durable steps, less those a committed newer branch abandoned."""
        gone = branch.superseded(self.store)
        return [s for s in layout.marked_steps(self.store) if s not in gone]


def _behind(store: Storage, durable: Storage) -> list[Storage]:
    """The stores whose newest step a save to `store` must not go behind: its own and, for a
    memory save, the durable folder too (else retention removes the older step persisted
    from memory by its number, and the next load resumes the newer one)."""
    return [store] if store is durable else [store, durable]
