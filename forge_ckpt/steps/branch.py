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

from ..errors import CheckpointCorruptError
from ..storage import Storage
from . import commit, layout
from .lock import Lease


def live_steps(store: Storage) -> list[int]:
    """Committed steps, less the abandoned ones not yet removed: what exists for a load,
    for retention and for the next step's number."""
    found = committed_manifests(store)
    gone = superseded(store, found)
    return [s for s in found if s not in gone]


def superseded(store: Storage, found: dict[int, layout.Manifest] | None = None) -> set[int]:
    """Committed steps that a committed step of a newer branch has abandoned. `found`: the
    committed steps' manifests, if the caller already read them."""
    found = committed_manifests(store) if found is None else found
    replaced = {pair for m in found.values() for pair in m.supersedes}
    return {s for s, m in found.items() if (s, m.created) in replaced}


def abandoned_copies(store: Storage, memory: Storage) -> list[int]:
    """The steps of `memory` (the memory tier) that a committed step of `store` (the durable
    folder) abandoned. A rollback's new branch names what it abandons in both tiers, and its
    first step is durable: only the durable folder's manifests outlive the driver."""
    replaced = {pair for m in committed_manifests(store).values() for pair in m.supersedes}
    numbers = {s for s, _ in replaced}
    out = []
    anyone = layout.Fence()
    for step in layout.all_steps(memory) if replaced else []:
        if step not in numbers:
            continue
        try:
            created = layout.read_committed(memory, step, fence=anyone).created
        except (CheckpointCorruptError, FileNotFoundError):
            continue  # no marker, or a damaged one: never loadable
        if (step, created) in replaced:
            out.append(step)
    return out


def committed_manifests(store: Storage) -> dict[int, layout.Manifest]:
    """Every committed step's manifest, ascending, in one pass (the lease's record read
    once). A damaged step is left out: load reports it; it never drops another step. For the
    folder's writer (under its lease): a reader that is not needs `layout.committed_steps`,
    which lists again if a commit ran meanwhile. Callers that need both the live steps and
    what was abandoned read it once and pass it on (each read is a listing and two GETs per
    step on object storage)."""
    fence = layout.read_fence(store)
    found = {}
    for step in layout.all_steps(store):
        if not fence.admits(step):
            continue
        try:
            found[step] = layout.read_committed(store, step, fence=fence)
        except CheckpointCorruptError:
            continue
    return found


def is_present(store: Storage, step: int, created: float) -> bool:
    """Whether the committed step `step` in the folder is the one created at `created` (and
    not a newer step of the same number)."""
    if not layout.is_marked(store, step):
        return False
    try:
        return layout.read_committed(store, step).created == created
    except CheckpointCorruptError:
        return False


def abandoned_by(store: Storage, branch_from: int) -> list[tuple[int, float]]:
    """What a new branch from `branch_from` abandons: every step newer than it with a
    readable COMMIT, recorded in the lease or not. A step whose commit's outcome was unknown
    (its lease record write failed) may still become recorded later, when the lease next
    writes its record: it must be abandoned by name now, or it would come back as the newest
    step of the folder."""
    out = []
    anyone = layout.Fence()  # every marker counts: recorded or not
    for step in layout.all_steps(store):
        if step <= branch_from:
            continue
        try:
            out.append((step, layout.read_committed(store, step, fence=anyone).created))
        except CheckpointCorruptError:
            continue  # no marker, or a damaged one: never loadable, so nothing to abandon
    return out


ASIDE = "replaced"


def set_aside(store: Storage, step: int) -> None:
    """Move committed step `step` out of the way of a new step with its number. Under the
    lease, checked first: a job that lost it must not move its successor's step away."""
    commit._writer(store, f"set step {step} aside", fresh=True)
    name = layout.step_name(step)
    store.makedirs(ASIDE)
    store.move_prefix(name, f"{ASIDE}/{name}", first=f"{name}/{layout.MARKER}")


def put_back(store: Storage, lease: Lease) -> list[int]:
    """Undo `set_aside` for every step whose replacement never committed (recording it in
    the lease again: the new step's preparation took it out); drop the copies of those
    whose replacement did, and half copies (no marker: a move that failed or crashed before
    the marker arrived, or after it left; the whole step is elsewhere, or was retired)."""
    back = []
    for name in store.list(ASIDE):
        step = layout.parse_step(name)
        if step is None:
            continue
        aside, marker = f"{ASIDE}/{name}", f"{ASIDE}/{name}/{layout.MARKER}"
        if layout.is_committed(store, step):  # the new step N committed (and recorded)
            store.delete_prefix(aside)
            continue
        try:
            generation = layout.marker_generation(store.read(marker))
        except FileNotFoundError:
            store.delete_prefix(aside)
            continue
        store.delete_prefix(name)  # the uncommitted new step's files
        # Recorded before it moves (its marker goes last in): at every moment one whole copy
        # counts, here or aside, and a crash in between is finished by the next start.
        lease.record(step, generation if generation is not None else lease.generation)
        store.move_prefix(aside, name, first=marker)
        back.append(step)
    return back


def recover(store: Storage, lease: Lease) -> None:
    """At a job's start, under the lease: finish what a crashed rollback left."""
    put_back(store, lease)
    retire_superseded(store)


def retire_superseded(store: Storage, found: dict[int, layout.Manifest] | None = None) -> list[int]:
    """Remove abandoned steps (marker first), once their replacement has committed.
    `found`: as for `superseded`."""
    gone = sorted(superseded(store, found))
    for step in gone:
        commit.remove_step(store, step)
    for name in store.list(ASIDE):  # replaced by a committed step N
        n = layout.parse_step(name)
        if n is not None and layout.is_committed(store, n):
            store.delete_prefix(f"{ASIDE}/{name}")
    return gone
