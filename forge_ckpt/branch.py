"""Rollback branches: which committed steps a newer branch has replaced.

After `load(step=K)` with newer steps in the folder, the first save starts a new branch. Its
manifest lists the steps it abandons (every committed step newer than K, each with its
manifest's creation time, so a later step of the new branch with the same number is never
mistaken for one of them). The abandoned steps stay until that first step commits (a failed
save loses nothing) and are removed right after; a crash in between leaves them in the
folder, where every load skips them and the next job's start removes them.

The one abandoned step whose number the new step takes (N) is set aside whole first
(`replaced/step-N`, marker last in, first out), so a save that fails, or a crash, puts it
back: the abort does at once, the next start otherwise.
"""

from __future__ import annotations

from . import commit, layout
from .errors import CheckpointCorruptError
from .lock import Lease
from .storage import Storage


def live_steps(store: Storage) -> list[int]:
    """Committed steps, less the abandoned ones not yet removed: what exists for a load,
    for retention and for the next step's number."""
    gone = superseded(store)
    return [s for s in layout.committed_steps(store) if s not in gone]


def superseded(store: Storage) -> set[int]:
    """Committed steps that a committed step of a newer branch has abandoned."""
    created: dict[int, float] = {}
    replaced: set[tuple[int, float]] = set()
    for step in layout.marked_steps(store):
        try:
            m = layout.read_committed(store, step)
        except CheckpointCorruptError:
            continue  # damaged: reported by load, never a reason to drop another step
        created[step] = m.created
        replaced.update(m.supersedes)
    return {s for s, t in created.items() if (s, t) in replaced}


def abandoned_by(store: Storage, branch_from: int) -> list[tuple[int, float]]:
    """What a new branch from `branch_from` abandons: the committed steps newer than it."""
    out = []
    for step in layout.committed_steps(store):
        if step > branch_from:
            out.append((step, layout.read_committed(store, step).created))
    return out


ASIDE = "replaced"


def set_aside(store: Storage, step: int) -> None:
    """Move committed step `step` out of the way of a new step with its number."""
    name = layout.step_name(step)
    store.makedirs(ASIDE)
    store.move_prefix(name, f"{ASIDE}/{name}", first=f"{name}/{layout.MARKER}")


def put_back(store: Storage, lease: Lease) -> list[int]:
    """Undo `set_aside` for every step whose replacement never committed (recording it in
    the lease again: the new step's preparation took it out); drop the copies of those
    whose replacement did."""
    back = []
    for name in store.list(ASIDE):
        step = layout.parse_step(name)
        if step is None:
            continue
        if layout.is_committed(store, step):  # the new step N committed (and recorded)
            store.delete_prefix(f"{ASIDE}/{name}")
            continue
        store.delete_prefix(name)  # the uncommitted new step's files
        marker = f"{ASIDE}/{name}/{layout.MARKER}"
        generation = layout.marker_generation(store.read(marker))
        # Recorded before it moves (its marker goes last in): at every moment one whole copy
        # counts, here or aside, and a crash in between is finished by the next start.
        lease.record(step, generation if generation is not None else lease.generation)
        store.move_prefix(f"{ASIDE}/{name}", name, first=marker)
        back.append(step)
    return back


def recover(store: Storage, lease: Lease) -> None:
    """At a job's start, under the lease: finish what a crashed rollback left."""
    put_back(store, lease)
    retire_superseded(store)


def retire_superseded(store: Storage) -> list[int]:
    """Remove abandoned steps (marker first), once their replacement has committed."""
    gone = sorted(superseded(store))
    for step in gone:
        commit.remove_step(store, step)
    for name in store.list(ASIDE):  # replaced by a committed step N
        n = layout.parse_step(name)
        if n is not None and layout.is_committed(store, n):
            store.delete_prefix(f"{ASIDE}/{name}")
    return gone
