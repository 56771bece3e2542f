"""`CheckpointCoordinator`: saves the trainer and every registered actor as one atomic step.

Reads top to bottom: registration, save (snapshot phase, persist phase, commit, retention),
load (choose a step, check it matches the job, prepare every unit, then apply), and the
helpers that turn a failed unit into an error that names it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import __version__, commit, layout
from .components import Unit, make_unit
from .config import CheckpointConfig
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
)
from .lock import FolderLock

log = logging.getLogger("forge_ckpt")


@dataclass
class SaveResult:
    """What one save wrote. In async mode `save()` returns it with `committed=False`;
    `wait()` returns the completed one."""

    step: int
    path: str
    nbytes: int = 0
    blocked_s: float = 0.0  # how long save() held the caller (the snapshot)
    total_s: float = 0.0  # until the commit marker was durable
    seconds: dict[str, float] = field(default_factory=dict)  # per component, until durable
    committed: bool = False


@dataclass
class LoadResult:
    step: int
    extra: Any
    path: str
    manifest: layout.Manifest


class CheckpointCoordinator:
    """Orchestrates save and load of one RL job; the only writer of its checkpoint folder."""

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self._lock = FolderLock(config.folder)
        try:
            os.makedirs(config.folder, exist_ok=True)
            self._lock.acquire()
            commit.remove_uncommitted(config.folder)
        except OSError as e:
            self._lock.release()
            raise CheckpointError(
                f"cannot open checkpoint folder {config.folder}: {e}. The folder must be "
                "writable by this job (it takes a lock and removes crash leftovers)"
            ) from e
        except BaseException:
            self._lock.release()
            raise
        self._trainer: list[Unit] = []
        self._actors: dict[str, list[Unit]] = {}
        self._pending: asyncio.Task | None = None

    # ---- registration -------------------------------------------------------------------

    def set_trainer(self, trainer: Any | Sequence[Any]) -> None:
        """One trainer actor, or the rank actors of one torch.distributed job (in rank order)."""
        ranks = list(trainer) if isinstance(trainer, (list, tuple)) else [trainer]
        self._trainer = [make_unit(layout.TRAINER, r, h, "") for r, h in enumerate(ranks)]

    def register(self, name: str, actor: Any | Sequence[Any], replace: bool = False) -> None:
        """An actor with state_dict/load_state_dict; a list registers replicas (kept apart).

        `replace=True` swaps in a restarted actor under a name already registered."""
        layout.check_name(name)
        if name in self._actors and not replace:
            raise ValueError(
                f"a component named {name!r} is already registered; pass replace=True to swap "
                "in a restarted actor"
            )
        handles = list(actor) if isinstance(actor, (list, tuple)) else [actor]
        if not handles:
            raise ValueError(f"register({name!r}, []) needs at least one actor")
        self._actors[name] = [
            make_unit(name, i, h, layout.actor_file(name, i)) for i, h in enumerate(handles)
        ]

    def _components(self) -> dict[str, list[Unit]]:
        comps = dict(self._actors)
        if self._trainer:
            comps[layout.TRAINER] = self._trainer
        return comps

    # ---- save ---------------------------------------------------------------------------

    async def save(self, step: int, extra: Any = None) -> SaveResult:
        """Save every component at `step` and commit. Sync mode: returns after the commit.
        Async mode: returns once every component holds its snapshot; `wait()` flushes."""
        await self.wait()
        if step in self.steps():
            log.warning("step %d is already committed; nothing to save", step)
            return SaveResult(step, layout.step_dir(self.config.folder, step), committed=True)
        background = self.config.async_mode == "async"
        start = time.perf_counter()
        try:
            path = await asyncio.to_thread(commit.prepare_step, self.config.folder, step)
        except OSError as e:
            await _discard(layout.step_dir(self.config.folder, step))
            raise self._save_error(step, [f"creating the step folder: {_describe(e)}"]) from e
        units = [u for us in self._components().values() for u in us]
        try:
            nbytes = await self._all(units, lambda u: u.begin(path, background), step, "snapshot")
        except BaseException:
            await _discard(path)
            raise
        result = SaveResult(step, path, sum(nbytes), blocked_s=time.perf_counter() - start)
        finish = self._finish_save(result, units, start, extra)
        if not background:
            return await finish
        self._pending = asyncio.create_task(finish)
        self._pending.add_done_callback(_log_background_failure)
        return result

    async def _finish_save(
        self, result: SaveResult, units: list[Unit], start: float, extra: Any
    ) -> SaveResult:
        try:
            records = await self._persisted(units, result, start)
            manifest = self._manifest(result.step, records, result.seconds, extra)
            await asyncio.to_thread(commit.commit_step, result.path, manifest)
        except BaseException as e:
            await _discard(result.path)
            if isinstance(e, (OSError, ValueError)):
                raise self._save_error(result.step, [f"commit: {_describe(e)}"]) from e
            raise
        result.nbytes = manifest.nbytes
        result.total_s = time.perf_counter() - start
        result.committed = True
        log.info(
            "committed step %d: %.1f MB in %.2fs", result.step, result.nbytes / 1e6, result.total_s
        )
        removed = await asyncio.to_thread(
            commit.apply_retention, self.config.folder, self.config.retention
        )
        if removed:
            log.info("retention removed steps %s", removed)
        return result

    async def _persisted(self, units: list[Unit], result: SaveResult, start: float):
        """Poll every unit until its files are durable; a unit never blocks its actor meanwhile."""
        records: dict[tuple[str, int], list] = {}
        delay = 0.002
        while len(records) < len(units):
            waiting = [u for u in units if (u.name, u.index) not in records]
            done = await self._all(waiting, lambda u: u.status(), result.step, "write")
            for u, recs in zip(waiting, done, strict=True):
                if recs is not None:
                    records[(u.name, u.index)] = recs
                    result.seconds[u.name] = time.perf_counter() - start
            if time.perf_counter() - start > self.config.save_timeout_s:
                late = [u.label for u in units if (u.name, u.index) not in records]
                raise self._save_error(
                    result.step,
                    [f"{x}: still writing after {self.config.save_timeout_s:.0f}s" for x in late],
                )
            if len(records) < len(units):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.05)
        return records

    def _manifest(self, step: int, records: dict, seconds: dict, extra: Any) -> layout.Manifest:
        comps = {}
        for name, units in self._components().items():
            files = [f for u in units for f in records[(name, u.index)]]
            kind = "trainer" if name == layout.TRAINER else "actor"
            comps[name] = layout.Component(kind, len(units), files, seconds.get(name, 0.0))
        return layout.Manifest(
            step=step,
            components=comps,
            extra=extra,
            fingerprint=self.config.fingerprint,
            versions={"forge_ckpt": __version__, "torch": torch.__version__},
            created=time.time(),
        )

    async def wait(self) -> SaveResult | None:
        """Wait for a background save; raises its error if it failed (never dropped)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        return await pending

    # ---- load ---------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return layout.committed_steps(self.config.folder)

    async def load(
        self, step: int | None = None, exclude: Iterable[str] = (), allow_mismatch: bool = False
    ) -> LoadResult | None:
        """Restore the newest committed step (or `step`) into every registered component.

        Returns None on a folder without committed steps. `exclude` skips components by name;
        "optimizer" keeps the trainer's fresh optimizer (weights-only fine-tuning).
        """
        await self.wait()
        exclude = set(exclude)
        marked = layout.marked_steps(self.config.folder)  # damaged ones are reported, not skipped
        if step is not None and step not in marked:
            raise CheckpointError(
                f"step {step} is not a committed step in {self.config.folder}; "
                f"committed steps: {self.steps() or 'none'}"
            )
        candidates = [step] if step is not None else marked[::-1]
        if not self.config.fallback:
            candidates = candidates[:1]
        for n, candidate in enumerate(candidates):
            try:
                return await self._load_step(candidate, exclude, allow_mismatch)
            except CheckpointCorruptError as e:
                if n + 1 == len(candidates):
                    raise
                log.warning(
                    "step %d is corrupt (%s); falling back to step %d",
                    candidate,
                    e,
                    candidates[n + 1],
                )
        return None

    async def _load_step(self, step: int, exclude: set[str], allow_mismatch: bool) -> LoadResult:
        path = layout.step_dir(self.config.folder, step)
        manifest = layout.read_committed(path)
        reshard = self._check_matches(manifest, exclude, allow_mismatch)
        plan = []
        for name, units in self._components().items():
            if name in exclude:
                continue
            comp = manifest.components[name]
            for u in units:
                plan.append((u, *self._load_args(u, comp, exclude, reshard)))
        verify = self.config.verify_on_load
        try:
            await self._all(
                [p[0] for p in plan],
                None,
                step,
                "load",
                calls=[u.prepare(path, recs, verify, opts) for u, recs, opts in plan],
            )
        except BaseException:
            await asyncio.gather(*(u.abort() for u, _, _ in plan), return_exceptions=True)
            raise
        await self._all([p[0] for p in plan], lambda u: u.apply(), step, "load")
        log.info("loaded step %d from %s", step, path)
        return LoadResult(step, manifest.extra, path, manifest)

    def _load_args(self, unit: Unit, comp: layout.Component, exclude: set[str], reshard: bool):
        if unit.name != layout.TRAINER:
            return [f for f in comp.files if f.path == unit.relpath], {}
        rank_file = None if reshard else layout.trainer_rank_file(unit.index)
        opts = {"load_optimizer": "optimizer" not in exclude, "rank_file": rank_file}
        return comp.files, opts

    def _check_matches(self, manifest: layout.Manifest, exclude: set[str], allow: bool) -> bool:
        """Raise CheckpointMismatchError listing every difference; True if the trainer reshards."""
        diffs, reshard = [], False
        saved, current = manifest.components, self._components()
        fp = self.config.fingerprint
        if fp is not None and manifest.fingerprint is not None and fp != manifest.fingerprint:
            diffs.append(
                f"run fingerprint changed: checkpoint={manifest.fingerprint}, current={fp}"
                " (the folder holds another run's checkpoints)"
            )
        for name in sorted(set(saved) | set(current)):
            if name in exclude:
                continue
            if name not in current:
                diffs.append(f"{name}: in the checkpoint (step {manifest.step}) but not registered")
            elif name not in saved:
                diffs.append(f"{name}: registered but not in the checkpoint (step {manifest.step})")
            elif saved[name].replicas != len(current[name]):
                what = "trainer ranks" if name == layout.TRAINER else "replicas"
                diffs.append(
                    f"{name}: {what} changed: checkpoint={saved[name].replicas}, "
                    f"current={len(current[name])}"
                )
                reshard = reshard or name == layout.TRAINER
        if diffs and not allow:
            raise CheckpointMismatchError(diffs)
        for d in diffs:
            log.warning("loading despite mismatch: %s", d)
        return reshard

    # ---- running calls on many units ------------------------------------------------------

    async def _all(
        self,
        units: list[Unit],
        call: Callable[[Unit], Awaitable] | None,
        step: int,
        phase: str,
        calls: list[Awaitable] | None = None,
    ) -> list:
        """Run one call per unit at once (trainer ranks' calls are collectives: never in
        sequence); any failure becomes one error naming every failed unit."""
        timeout = self.config.load_timeout_s if phase == "load" else self.config.save_timeout_s
        aws = calls if calls is not None else [call(u) for u in units]
        tasks = [asyncio.ensure_future(a) for a in aws]
        done, pending = await asyncio.wait(tasks, timeout=timeout) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        failures = []
        for u, t in zip(units, tasks, strict=True):
            if t in pending:
                failures.append((u, TimeoutError(f"no answer within {timeout:.0f}s")))
            elif t.exception() is not None:
                failures.append((u, t.exception()))
        if failures:
            raise self._error(step, phase, failures)
        return [t.result() for t in tasks]

    def _error(self, step: int, phase: str, failures: list) -> Exception:
        causes = [(u, _unwrap(e)) for u, e in failures]
        if phase == "load":
            # forge_ckpt's own errors (corrupt file, mismatch) are raised as they are.
            for _, c in causes:
                if isinstance(c, CheckpointError):
                    return c
            lines = [f"{u.label}: {_describe(c)}" for u, c in causes]
            return CheckpointError(
                f"load of step {step} failed, nothing was applied:\n  " + "\n  ".join(lines)
            )
        return self._save_error(step, [f"{u.label}: {_describe(c)}" for u, c in causes])

    def _save_error(self, step: int, lines: list[str]) -> CheckpointSaveError:
        newest = self.steps()
        prev = (
            f"step {newest[-1]} is still the newest committed step"
            if newest
            else "there is no committed step yet"
        )
        return CheckpointSaveError(
            f"save of step {step} aborted, nothing was committed ({prev}):\n  "
            + "\n  ".join(lines)
            + "\nFix or restart the failing component(s) and save again."
        )

    # ---- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Release the folder lock. Call `await wait()` first to flush a background save."""
        if self._pending is not None and not self._pending.done():
            log.warning("close() with a background save still running: it will not commit")
            self._pending.cancel()
        self._lock.release()

    async def __aenter__(self) -> CheckpointCoordinator:
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                await self.wait()
        finally:
            self.close()


async def _discard(path: str) -> None:
    """Remove an aborted step's files; a failure here must not hide the save's own error."""
    try:
        await asyncio.to_thread(commit.remove_step, path)
    except OSError as e:
        log.warning(
            "could not remove aborted step %s (%s); it is not committed and will be "
            "removed at the next start",
            path,
            e,
        )


def _unwrap(e: BaseException) -> BaseException:
    """The user's exception inside a Ray task error, when Ray kept it."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


def _describe(e: BaseException) -> str:
    import ray.exceptions as rex

    if isinstance(e, rex.RayActorError):
        return "the actor died (RayActorError); restart it and register it again"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


def _log_background_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error(
            "background save failed (raised again by the next save() or wait()): %s",
            task.exception(),
        )
