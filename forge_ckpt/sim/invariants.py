"""The promises, checked against what storage really holds (read without faults or delays).

- I1 no loss: a step reported committed stays until retention (keep_last newer committed
  steps of its branch exist) or a rollback whose new branch committed removes it.
- I2 load: `load()` returns the newest committed step that is legit (written under the
  lease it held when it landed), not abandoned by a committed newer branch; never another.
- I3 fencing: a step whose marker landed after its writer lost the lease is never listed by
  the product's readers, never loaded, and was never reported committed; a writer taken over
  is never told "committed" for its successor's step (a report of its own step that came
  after the successor retired or abandoned it is true).
- I4 all or nothing: a load leaves every component at the loaded step, or every component as
  it was (or its error names what was applied).
- I5 folders: nothing outside the job's folder changes (a sibling folder that shares its
  name's prefix keeps its objects and its unfinished upload).
- I6 bounded: no call waits forever (the loop's deadlock detection), and a folder can always be
  opened again (a run of failed opens is a violation).
- I7 no false alarm: a job is told that another writer took its folder only if one did
  (a lost reply to its own conditional write is not another writer).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..errors import CheckpointCorruptError
from ..steps import branch, layout
from ..storage import Storage

Identity = tuple[int, float]  # a step and its manifest's creation time


class Violation(AssertionError):
    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant


@dataclass
class Oracle:
    view: Storage  # the job's folder, read without gates
    aside: Storage  # its replaced/ folder (branch.ASIDE), likewise
    keep_last: int | None
    seen: list[Identity] = field(default_factory=list)  # legit steps seen, in order
    abandoned: set[Identity] = field(default_factory=set)
    accepted: dict[int, set[Identity]] = field(default_factory=dict)  # lease gen -> at takeover
    late: set[Identity] = field(default_factory=set)
    branch_point: int | None = None  # the step of the last load(step=K)
    at_branch: set[Identity] = field(default_factory=set)  # what was seen at that load
    retired: set[Identity] = field(default_factory=set)  # removed with a reason, when seen
    writers: dict[Identity, int] = field(default_factory=dict)  # every step read: its generation
    changes: Changes | None = None  # what may have changed (None: read everything each time)
    _cache: tuple[int, dict[Identity, layout.Manifest], dict[int, layout.Manifest]] | None = None
    _steps: tuple[int, list[dict[int, tuple[bytes, layout.Manifest]]]] | None = None
    _seen: tuple[int, dict[int, int]] = (-1, {})  # `changes.wide` and `.step` when last read
    _gen: tuple[int, int] | None = None  # (changes.any, the lease's generation then)

    # ---- reading the truth ------------------------------------------------------------------
    def present(self) -> dict[Identity, int]:
        """Every step with a valid marker: identity -> the generation that wrote it."""
        return {i: m.generation for i, m in self.manifests().items()}

    def manifests(self) -> dict[Identity, layout.Manifest]:
        """Valid steps, including one a rollback set aside (it is put back if its
        replacement fails: still there, as far as a loss goes)."""
        return self._read()[1]

    def _committed_in_view(self) -> dict[int, layout.Manifest]:
        """The folder's committed steps: what `branch.committed_manifests(view)` reads."""
        return self._read()[2]

    def _read(self) -> tuple[int, dict[Identity, layout.Manifest], dict[int, layout.Manifest]]:
        epoch = self.changes.any if self.changes is not None else -1
        if self._cache is not None and self._cache[0] == epoch and epoch >= 0:
            return self._cache
        out, view = {}, {}
        for store, found in zip((self.view, self.aside), self._steps_there(), strict=True):
            fence = layout.read_fence(store)  # once: nothing changes while the oracle reads
            for s, (marker, m) in found.items():
                if fence.admits(s) and fence.problem(s, marker) is None:
                    out[(s, m.created)] = m  # read_committed(store, s, fence=fence) would
                    if store is self.view:
                        view[s] = m
        self.writers.update({i: m.generation for i, m in out.items()})
        self._cache = (epoch, out, view)
        return self._cache

    def _steps_there(self) -> list[dict[int, tuple[bytes, layout.Manifest]]]:
        """Each store's steps whose marker and manifest check out, whatever the lease's record
        says: (the marker's bytes, the manifest). Read again only when more than the lease
        changed (a renewal or a record write changes only which of them count: the fence),
        and then only the steps whose marker or manifest changed, unless a write could not
        be tied to one step (a folder removed or moved)."""
        stores = (self.view, self.aside)
        ch = self.changes
        if ch is None:
            return [_checked_steps(st) for st in stores]
        if self._steps is not None and self._steps[0] == ch.steps:
            return self._steps[1]
        if self._steps is None or self._seen[0] != ch.wide:
            found = [_checked_steps(st) for st in stores]
        else:
            dirty = [n for n, e in ch.step.items() if self._seen[1].get(n) != e]
            old = self._steps[1]
            found = [_patched(st, was, dirty) for st, was in zip(stores, old, strict=True)]
        self._seen = (ch.wide, dict(ch.step))
        self._steps = (ch.steps, found)
        return found

    def lease_generation(self) -> int:
        epoch = self.changes.any if self.changes is not None else -1
        if self._gen is None or self._gen[0] != epoch or epoch < 0:
            self._gen = (epoch, self._read_generation())
        return self._gen[1]

    def _read_generation(self) -> int:
        got = self.view.read_tagged(layout.LEASE)
        if got is None:
            return 0
        try:
            return int(json.loads(got[0]).get("generation", 0))
        except ValueError:
            return 0

    # ---- events -----------------------------------------------------------------------------
    def opened(self, generation: int) -> None:
        """A job took the lease: what is committed now is what it accepts."""
        self.refresh()
        self.accepted[generation] = {i for i in self.present() if i not in self.late}

    def refresh(self) -> None:
        """Mark steps that landed under an older generation after a newer one took over."""
        gen = self.lease_generation()
        known = self.accepted.get(gen)
        if known is None:
            return
        for ident, g in self.present().items():
            if g < gen and ident not in known:
                self.late.add(ident)

    def observe(self) -> None:
        """A marker landed or went: every committed step visible now is held to I1."""
        self._update()
        self.check_storage()

    def _update(self) -> None:
        self.refresh()
        for ident, m in sorted(self.manifests().items(), key=lambda x: (x[0][1], x[0][0])):
            if ident in self.late:
                continue
            if ident in self.seen:
                continue
            self.seen.append(ident)
            for old in m.supersedes:  # a committed new branch abandons these
                if self.branch_point is None or old[0] <= self.branch_point:
                    raise Violation("I1 no loss", f"step {ident[0]} abandons {old[0]}, "
                                    f"not newer than the rollback to {self.branch_point}")  # fmt: skip
                if tuple(old) in self.seen and tuple(old) not in self.at_branch:
                    raise Violation("I1 no loss", f"step {ident[0]} abandons step {old[0]}, "
                                    "committed after the rollback it branches from")  # fmt: skip
                self.abandoned.add(tuple(old))  # type: ignore[arg-type]

    def committed(
        self, step: int, branch_from: int | None, generation: int | None = None
    ) -> Identity:
        """A save reported its step committed: it must be there and legit (I1, I3), or, for a
        writer of lease `generation` since taken over, have been: a step it committed under
        its lease that its successor then retired or abandoned (its report came late)."""
        self.refresh()
        mine = [i for i in self.present() if i[0] == step]
        if generation is not None and generation < self.lease_generation():
            # taken over: a step of its successor's is not its own ("already committed")
            mine = [i for i in mine if self.writers[i] <= generation]
        if not mine:
            gone = self._gone(step, generation)
            if gone is None:
                raise Violation("I3 fencing", f"save({step}) reported committed, no valid marker")
            return gone  # _gone observed
        ident = mine[0]
        if ident in self.late:
            raise Violation("I3 fencing", f"save({step}) reported committed, written late")
        self.observe()
        return ident

    def _gone(self, step: int, generation: int | None) -> Identity | None:
        """The newest step `step` that the writer of lease `generation` made visible, if it
        was legit (seen, never late) and went as the invariants allow (retention, or a
        rollback whose new branch committed); None otherwise. Only a writer taken over
        qualifies: the folder's holder sees its own steps go only by its own hand."""
        self.observe()  # judge whatever went since the last look (I1) before counting on it
        if generation is None or generation >= self.lease_generation():
            return None
        ours = [i for i, g in self.writers.items() if i[0] == step and g == generation]
        if not ours:
            return None
        ident = max(ours, key=lambda i: i[1])
        legit = ident in self.seen and ident not in self.late
        if legit and (ident in self.retired or ident in self.abandoned):
            return ident
        return None

    def rolled_back(self, step: int) -> None:
        """load(step=K): a new branch may abandon what is committed now, or has a marker now
        (a commit of unknown outcome, which a later lease write may still record), nothing
        later."""
        self._update()
        self.branch_point, self.at_branch = step, set(self.seen) | self._markers()

    def _markers(self) -> set[Identity]:
        """Every step with a marker and a readable manifest, recorded in the lease or not."""
        out = set()
        for s in layout.all_steps(self.view):
            try:
                m = layout.read_committed(self.view, s, fence=layout.Fence())
            except CheckpointCorruptError:
                continue
            out.add((s, m.created))
        return out

    # ---- checks -----------------------------------------------------------------------------
    def check_storage(self) -> None:
        """I1 and I3 on what storage holds now (run at every marker created or removed)."""
        self._update()
        present = self.present()
        live = [i for i in self.seen if i not in self.abandoned]
        for n, ident in enumerate(live):
            if ident in present or ident in self.retired:
                continue
            newer = len(live) - n - 1
            if self.keep_last is None or newer < self.keep_last:
                raise Violation(
                    "I1 no loss",
                    f"committed step {ident[0]} is gone with only {newer} newer committed "
                    f"step(s) (keep_last={self.keep_last})",
                )
            self.retired.add(ident)  # judged when it went: later branches change nothing
        late = self.late & set(present)
        listed = set(layout.committed_steps(self.view)) if late else set()
        for ident in late:
            if ident[0] in listed:
                raise Violation(
                    "I3 fencing", f"step {ident[0]} landed after its writer lost the lease "
                    "and readers list it",
                )  # fmt: skip

    def check_files(self) -> None:
        """I1 on the data too: every step the product's readers list is whole (its files
        match its manifest), also after every request still in flight has landed."""
        for s in layout.committed_steps(self.view):
            try:
                m = layout.read_committed(self.view, s)
                for f in m.files:
                    self.view.verify(f"{layout.step_name(s)}/{f.path}", f)
            except CheckpointCorruptError as e:
                raise Violation("I1 no loss", f"committed step {s} is damaged: {e}") from None

    def expected_load(self) -> int | None:
        return max((i[0] for i in self.loadable()), default=None)

    def loadable(self) -> list[Identity]:
        """Durable steps a load may return: committed, legit, not abandoned."""
        found = self._committed_in_view()  # (layout.is_committed(view, step) for each)
        gone = branch.superseded(self.view, found)
        return [i for i in self.present()
                if i[0] in found and i not in self.late and i[0] not in gone]  # fmt: skip

    def check_load(self, got: int | None, before: int | None = None, lost: bool = False) -> None:
        """`before`: the newest legit step when the load began. A load whose job lost the
        folder to another meanwhile (`lost`) may return it: it counts the steps its read of
        the lease's record vouched for, and the successor's commits came after that read
        (seed 6406: job1's load returns step 3 at 143.10, after its successor committed
        step 4; tests/test_sim.py). A load is held to "now" otherwise."""
        self.refresh()
        want = self.expected_load()
        if got != want and not (lost and got == before):
            raise Violation("I2 load", f"load() returned step {got}, the newest legit is {want}"
                            + (f" (it was {before} when the load began)" if lost else ""))  # fmt: skip


def _checked_steps(store: Storage) -> dict[int, tuple[bytes, layout.Manifest]]:
    """Every step of `store` with a marker and a manifest that check out (no fence)."""
    out = {}
    for s in layout.all_steps(store):
        got = _checked_step(store, s)
        if got is not None:
            out[s] = got
    return out


def _checked_step(store: Storage, s: int) -> tuple[bytes, layout.Manifest] | None:
    try:
        marker = bytes(store.read(f"{layout.step_name(s)}/{layout.MARKER}", 0, 4096))
        return marker, layout.read_committed(store, s, fence=layout.Fence())
    except (CheckpointCorruptError, FileNotFoundError):
        return None


def _patched(
    store: Storage, old: dict[int, tuple[bytes, layout.Manifest]], dirty: list[int]
) -> dict[int, tuple[bytes, layout.Manifest]]:
    """`old` with the steps in `dirty` read again (in step order, as a listing gives them)."""
    new = dict(old)
    for s in dirty:
        got = _checked_step(store, s)
        if got is None:
            new.pop(s, None)
        else:
            new[s] = got
    return dict(sorted(new.items()))


_STEP_IN_PATH = re.compile(r"(?:^|/)step-(\d+)/")


@dataclass
class Changes:
    """What storage writes may have changed of what the oracle reads (the world counts them
    at its gate): `any`, every such write; `steps`, those to anything but the lease; `wide`,
    those it cannot tie to one step number (a folder removed or moved, a batch); `step[N]`,
    those to a marker or manifest of a step N (in whichever folder: at worst a read more)."""

    any: int = 0
    steps: int = 0
    wide: int = 0
    step: dict[int, int] = field(default_factory=dict)

    def wrote(self, path: str, one_path: bool) -> None:
        """A write to `path` (`one_path`: the operation changes that one object only)."""
        self.any += 1
        if path.endswith(layout.LEASE):
            return
        self.steps += 1
        m = _STEP_IN_PATH.search(path) if one_path else None
        if m is None:
            self.wide += 1
        else:
            n = int(m.group(1))
            self.step[n] = self.step.get(n, 0) + 1
