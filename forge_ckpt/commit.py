"""The commit protocol and retention: the only code that makes a step visible or removes one.

Save:   prepare_step (fresh empty folder) -> components write + fsync their own files ->
        commit_step: check every reported file, write manifest (atomic), fsync folders,
        write COMMIT (atomic, last). A crash before COMMIT's rename leaves no step.
Delete: COMMIT first (and fsync the folder), then the rest, so a half-deleted step is never
        loadable. Retention runs only after a newer step is committed and never removes the
        newest committed step.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass

from . import layout
from .errors import CheckpointSaveError
from .storage import atomic_write, fsync_dir

log = logging.getLogger("forge_ckpt")


def prepare_step(folder: str, step: int) -> str:
    """Create an empty `step-N/` (with `actors/` and `trainer/`) for components to write into.

    Components never create the step folder themselves: a component that outlives an aborted
    save cannot recreate a folder that was removed.
    """
    path = layout.step_dir(folder, step)
    if os.path.exists(path):
        if step in layout.marked_steps(folder):
            raise CheckpointSaveError(
                f"step {step} is already committed at {path}; save a different step number"
            )
        log.warning("removing uncommitted leftover %s before saving step %d", path, step)
        remove_step(path)
    os.makedirs(os.path.join(path, "actors"))
    os.makedirs(os.path.join(path, layout.TRAINER))
    fsync_dir(folder)
    return path


def commit_step(path: str, manifest: layout.Manifest) -> None:
    """Make a fully written step visible. Every component's files must already be fsynced."""
    for rec in manifest.files:
        full = os.path.join(path, rec.path)
        try:
            size = os.path.getsize(full)
        except FileNotFoundError:
            raise CheckpointSaveError(f"{full} was reported written but does not exist") from None
        if size != rec.size:
            raise CheckpointSaveError(f"{full} has {size} bytes, its writer reported {rec.size}")
    for sub in ("actors", layout.TRAINER, ""):
        fsync_dir(os.path.join(path, sub))
    crc = atomic_write(os.path.join(path, layout.MANIFEST), manifest.to_bytes())
    atomic_write(os.path.join(path, layout.MARKER), layout.marker_bytes(manifest.step, crc))
    fsync_dir(os.path.dirname(path))


def remove_step(path: str) -> None:
    """Remove a step folder, marker first, so that it is never seen half-deleted."""
    marker = os.path.join(path, layout.MARKER)
    if os.path.exists(marker):
        os.unlink(marker)
        fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):
        shutil.rmtree(path)  # second try raises with the reason


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


def apply_retention(folder: str, policy: RetentionPolicy) -> list[int]:
    """Delete committed steps the policy does not keep; returns the steps removed."""
    removed = policy.to_delete(layout.committed_steps(folder))
    for step in removed:
        remove_step(layout.step_dir(folder, step))
        log.info("retention: removed step %d", step)
    return removed


def remove_uncommitted(folder: str) -> list[int]:
    """Remove leftovers of crashed saves (steps without a COMMIT file). Call only while
    holding the folder lock. Committed steps whose marker or manifest is damaged stay: they
    are reported by load() and `forge-ckpt verify`, not silently deleted."""
    marked = set(layout.marked_steps(folder))
    leftovers = [s for s in layout.all_steps(folder) if s not in marked]
    for step in leftovers:
        path = layout.step_dir(folder, step)
        try:
            remove_step(path)
        except OSError as e:  # it has no marker: harmless for load; a save of N says so
            log.warning("could not remove uncommitted leftover %s: %s", path, e)
            continue
        log.warning("removed uncommitted leftover step-%d (a save that never committed)", step)
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if ".tmp." in name:
            os.unlink(os.path.join(folder, name))
    return leftovers
