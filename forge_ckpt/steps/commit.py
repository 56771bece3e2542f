"""The commit protocol and retention: the only code that makes a step visible or removes one.

Save:   prepare_step (fresh empty step) -> components write their own files durably and report
        them (path, size, crc32c) -> commit_step: from those records alone (the driver never
        lists or stats what others wrote: on another node it may not even see their disk),
        create the manifest, then create COMMIT, then record COMMIT in the folder's lease
        (lock.Lease.record, a conditional replace): that record is the commit point. Manifest
        and COMMIT are create-if-absent: on a POSIX folder temp file + fsync + link +
        fsync(folder), on S3 `If-None-Match: *`. A crash before the record leaves no step.
Fence:  a writer that lost the lease fails its record write, is told its step is NOT
        committed, and its COMMIT counts for no reader (layout.Fence); the folder's holder
        removes such a step as a leftover and may save that step number itself. Every function
        here that changes a folder refuses (CheckpointLockedError) once this process's lease
        on that storage object was lost. Without a lease (a folder opened by no Lease of this
        process: tests, the memory tier) nothing is recorded and every COMMIT counts.
Delete: COMMIT first (made durable), then the rest, so a half-deleted step is never loadable.
        Retention runs only after a newer step is committed and never removes the newest.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointLockedError, CheckpointSaveError
from ..storage import AlreadyExistsError, Storage, crc32c_of_bytes
from ..storage.base import before_delete
from . import layout
from .lock import Lease, lease_of
from .signing import Signer

log = logging.getLogger("forge_ckpt")


def prepare_step(store: Storage, step: int) -> None:
    """An empty `step-N/` (with `actors/` and `trainer/` on POSIX) for components to write.

    Components never create the step folder themselves: a component that outlives an aborted
    save cannot recreate a folder that was removed.
    """
    lease = _writer(store, f"save step {step}")
    name = layout.step_name(step)
    if layout.all_steps(store).count(step):
        if layout.is_marked(store, step):
            raise CheckpointSaveError(
                f"step {step} is already committed at {store.where(name)}; save a different "
                "step number"
            )
        if lease is None:
            # A store fenced by its caller's lease (the memory tier) has no lease of its own:
            # the "leftover" may be the step its successor is writing now (no COMMIT yet), so
            # the caller's lease must be fresh before it goes (sim seed 16233).
            before_delete()
        log.warning("removing uncommitted leftover %s before saving step %d", name, step)
        remove_step(store, step)
    if lease is not None:  # a removed step's record must not vouch for this save's COMMIT
        lease.forget([step], write=True)
    store.fence_step(step)  # the memory tier: an earlier attempt's late writes are refused
    store.makedirs(f"{name}/{layout.ACTORS}")
    store.makedirs(f"{name}/{layout.TRAINER}")
    _still_ours(store, step)


def _still_ours(store: Storage, step: int) -> None:
    """The components write next. A preparation that stalled past a third of the TTL renews
    here, so a job taken over meanwhile learns it before its actors write into a folder its
    successor may be preparing (their create-only write failed its save as "another writer":
    the simulation's revert `stale-prepare`)."""
    _writer(store, f"save step {step}")


def commit_step(
    store: Storage,
    manifest: layout.Manifest,
    fence: Callable[[], None] | None = None,
    signer: Signer | None = None,
) -> None:
    """Make a fully written step visible. Every component's files must already be durable.

    With this process's lease on `store`, the step is committed when `Lease.record` wrote its
    COMMIT into the lease; if the lease was lost, CheckpointLockedError says it is NOT. `fence`
    (a storage without that lease: the memory tier) runs right before the marker and raises
    if this writer lost the folder to another.
    """
    lease = _writer(store, f"commit step {manifest.step}", fence)
    sign = signer.sign if signer is not None else _unsigned
    _commit(store, manifest.step, manifest.to_bytes(), manifest.generation, lease, fence, sign)


def commit_copy(store: Storage, step: int, data: bytes, signature: str | None) -> None:
    """Commit a step whose files were copied in from another folder (forge_ckpt.steps.transfer):
    its manifest byte for byte (so the signature of it, carried over, stays valid), then a
    COMMIT naming this writer's lease generation, then the record. Only under a lease."""
    lease = _writer(store, f"commit the copy of step {step}")
    if lease is None:
        raise CheckpointLockedError(f"{store.url}: a copied step is committed under a lease only")
    _commit(store, step, data, lease.generation, lease, None, lambda _data: signature)


def _unsigned(_data: bytes) -> str | None:
    return None


def _commit(
    store: Storage,
    step: int,
    data: bytes,
    generation: int,
    lease: Lease | None,
    fence: Callable[[], None] | None,
    sign: Callable[[bytes], str | None],
) -> None:
    """The protocol's last writes: manifest, COMMIT, record (see commit_step)."""
    name = layout.step_name(step)
    guard = lease if lease is not None else _borrowed(store, fence)
    try:
        for sub in (layout.ACTORS, layout.TRAINER, ""):
            store.sync_dir(f"{name}/{sub}" if sub else name)
        _create(store, f"{name}/{layout.MANIFEST}", data, guard)
        if lease is not None:
            lease.check()  # a holder that knows it was taken over writes no COMMIT
        if fence is not None and (lease is None or fence != lease.renew):
            fence()
        marker = layout.marker_bytes(step, crc32c_of_bytes(data), generation, sign(data))
    except AlreadyExistsError as e:
        raise _another_writer(step, e) from None
    except OSError as e:  # no COMMIT was written: certainly not committed
        e.not_committed = True  # type: ignore[attr-defined]
        raise
    try:
        _create(store, f"{name}/{layout.MARKER}", marker, guard)
    except AlreadyExistsError as e:
        raise _another_writer(step, e) from None
    store.sync_dir("")
    if lease is not None:
        lease.record(step, generation)  # the commit point


def _borrowed(store: Storage, fence: Any) -> Lease | None:
    """A store without a lease of its own (the memory tier: `fenced_by_caller`) is fenced by
    its writer's lease on the durable folder: under it, a create that meets a leftover of a
    writer that lost that lease replaces it, as in the folder (else a stale job's memory
    manifest broke its successor's save of that step: sim seed 216)."""
    owner = getattr(fence, "__self__", None)
    if isinstance(owner, Lease) and getattr(store, "fenced_by_caller", False):
        return owner
    return None


def _another_writer(step: int, e: BaseException) -> CheckpointSaveError:
    return CheckpointSaveError(
        f"step {step}: another writer is committing the same step ({e}); only one job may "
        "write a checkpoint folder"
    )


def _writer(store: Storage, what: str, fence: Any = None, fresh: bool = False) -> Lease | None:
    """The caller's lease on `store`: the one `fence` is a method of, else this process's
    (None: none). Refuses if it was lost to another job (a holder that stalled past a third of
    its TTL renews first, and so learns it). `fresh`: renew now (see `Lease.check`)."""
    lease = getattr(fence, "__self__", None)
    if not isinstance(lease, Lease) or lease.store is not store:
        lease = lease_of(store)
    if lease is not None:
        try:
            lease.check(fresh)
        except CheckpointLockedError as e:
            raise CheckpointLockedError(
                f"cannot {what} in {store.url}: {e}. Whatever this job left there is "
                "removed by the folder's holder"
            ) from None
    return lease


def _create(store: Storage, path: str, data: bytes, lease: Lease | None) -> None:
    """Create-if-absent. Under our lease, an object already there that is not ours is a late
    write of a writer that lost the lease (prepare_step emptied the step): replace it."""
    try:
        store.create(path, data)
        return
    except AlreadyExistsError:
        if lease is None:
            raise
    try:
        if bytes(store.read(path)) == data:
            return  # our own create, applied although its reply was lost
    except FileNotFoundError:
        pass
    # Check the lease again right before removing anything: our own create may have taken
    # longer than the TTL, and what is there may be the committed step of the job that took
    # the folder over meanwhile (check() renews, and so learns it, once a third of the TTL
    # has passed since the last renewal).
    lease.check(fresh=True)
    log.warning("removing %s: a late write of a writer that lost the lease", store.where(path))
    store.delete(path)
    store.create(path, data)


def remove_step(store: Storage, step: int) -> None:
    """Remove a step, marker first, so that it is never seen half-deleted."""
    lease = _writer(store, f"remove step {step}", fresh=True)
    if lease is None:  # the memory tier: its caller's lease, fresh (a stale job's retention
        before_delete()  # would remove its successor's memory step of that number)
    name = layout.step_name(step)
    store.delete(f"{name}/{layout.MARKER}")  # durable before anything else goes
    if lease is not None:
        lease.forget([step])
    store.delete_prefix(name)


def remove_if_uncommitted(store: Storage, step: int) -> bool:
    """Remove an aborted save's step unless it has a marker (then it is committed, or the
    abort cannot tell: a step is never removed on a guess), and only under a lease still
    held (a writer that lost the folder must not delete its successor's files). True if
    removed."""
    lease = _writer(store, f"remove the aborted step {step}")
    if store.exists(f"{layout.step_name(step)}/{layout.MARKER}"):
        log.warning("step %d has a commit marker: not removing it", step)
        return False
    if lease is not None:
        lease.check(fresh=True)  # again, right before the delete: the look may have taken long
    else:  # the memory tier: its caller's lease, fresh (see prepare_step)
        before_delete()
    store.delete_prefix(layout.step_name(step))
    return True


def quarantine_step(store: Storage, step: int) -> str:
    """Move a damaged committed step aside (kept for inspection, reported by `forge-ckpt
    list`), so that the same step number can be committed again."""
    lease = _writer(store, f"quarantine step {step}", fresh=True)
    # The time says when; the suffix keeps two quarantines of one step in a second apart.
    dest = f"{layout.QUARANTINE}/{layout.step_name(step)}.{int(time.time())}-{uuid.uuid4().hex[:6]}"
    store.makedirs(layout.QUARANTINE)
    store.move_prefix(
        layout.step_name(step), dest, first=f"{layout.step_name(step)}/{layout.MARKER}"
    )
    if lease is not None:
        lease.forget([step])
    log.warning("moved damaged step %d to %s", step, store.where(dest))
    return dest


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest `keep_last` committed steps, plus every step divisible by `keep_every`."""

    keep_last: int | None = 3
    keep_every: int | None = None

    def to_delete(self, committed: list[int]) -> list[int]:
        if not committed or self.keep_last is None:
            return []
        keep = set(committed[-max(self.keep_last, 1) :])
        if self.keep_every:
            keep |= {s for s in committed if s % self.keep_every == 0}
        return [s for s in committed if s not in keep]


def apply_retention(
    store: Storage, policy: RetentionPolicy, committed: list[int] | None = None
) -> list[int]:
    """Delete committed steps the policy does not keep; returns the steps removed.
    `committed`: the steps that count (default: every committed step)."""
    steps = layout.committed_steps(store) if committed is None else committed
    removed = policy.to_delete(steps)
    for step in removed:
        remove_step(store, step)
        log.info("retention: removed step %d", step)
    return removed


def retire_after(store: Storage, step: int) -> list[int]:
    """Remove every step newer than `step` (marker first): the abandoned branch of a rollback."""
    newer = [s for s in layout.all_steps(store) if s > step]
    for s in newer:
        remove_step(store, s)
        log.warning("rollback to step %d: retired step %d of the abandoned branch", step, s)
    return newer


# A replaced lease's temp file (LocalStorage._write_temp) left by a crash.
_LEASE_TEMP = re.compile(re.escape(layout.LEASE) + r"\.tmp\.\d+\.[0-9a-f]{8}")


def remove_uncommitted(store: Storage) -> list[int]:
    """Remove leftovers of crashed saves and of writers that lost the lease (steps without a
    COMMIT the lease records, temp files, unfinished multipart uploads). Call only while
    holding the folder's lease. Committed steps whose marker or manifest is damaged stay:
    load() and `forge-ckpt verify` report them."""
    lease = _writer(store, "remove leftovers")
    marked = set(layout.marked_steps(store))
    present = layout.all_steps(store)
    leftovers = [s for s in present if s not in marked]
    if lease is not None:  # records of steps that are gone: keeps the lease small
        lease.forget([s for s in lease.committed if s not in present])
    for step in leftovers:
        try:
            remove_step(store, step)
        except OSError as e:  # it has no marker: harmless for load; a save of N says so
            log.warning("could not remove uncommitted leftover step-%d: %s", step, e)
            continue
        log.warning("removed uncommitted leftover step-%d (a save that never committed)", step)
    for name in store.list(""):  # only ours: a folder at a bucket's root shares it
        if _LEASE_TEMP.fullmatch(name):
            store.delete(name)
    store.abort_uploads("")
    return leftovers


def remove_strays(store: Storage, signer: Signer | None = None) -> list[str]:
    """Remove, in committed steps, actor files of a replica whose manifest names another save
    attempt's file for it: a write of an aborted attempt, or of a job that lost the lease,
    that landed after the step was committed (each attempt names its own files, so such a
    write lands beside the step's, never on them: docs/protocol.md, rule 9). A step whose
    manifest does not check out (`signer`: its signature too) is left alone. Call only while
    holding the folder's lease."""
    removed = []
    for step in layout.committed_steps(store):
        try:
            manifest = layout.read_committed(store, step, signer)
        except Exception:  # noqa: BLE001 - damaged: load() and `verify` report it, not this
            continue
        name = layout.step_name(step)
        strays = layout.other_attempts(manifest, store.list(f"{name}/{layout.ACTORS}"))
        for path in strays:
            _writer(store, f"remove stray files of step {step}", fresh=True)
            store.delete(f"{name}/{path}")
            removed.append(f"{name}/{path}")
            log.warning("removed %s/%s: a late write of another save attempt", name, path)
    return removed
