"""The memory tier as the coordinator sees it: start or find this run's holders (one detached
actor per node, named after the run), retire holders left by another run, tell whether a
memory step is still whole, and persist a memory step to the durable folder from the
holders' copies (the units are not involved a second time).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import ray

from .. import commit, layout
from ..errors import CheckpointCorruptError, CheckpointError
from ..storage import FileRecord, Storage, StorageSpec, open_storage
from .holder import HolderActor
from .placement import HolderRef, holder_name
from .store import MemoryStorage, forget

log = logging.getLogger("forge_ckpt")


def run_id_of(folder: str) -> str:
    """The same durable folder gives the same run id, so a restarted driver finds its holders."""
    return hashlib.sha256(folder.encode()).hexdigest()[:16]


def _alive_nodes() -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


def open_tier(config: Any, on_error: Callable[[], None]) -> MemoryTier | None:
    """The memory tier when configured (`memory_every`); `on_error` (the lease's release)
    runs if it cannot start, so a failed coordinator never keeps the folder."""
    if not config.memory_every:
        return None
    try:
        return MemoryTier(config)
    except BaseException:
        on_error()
        raise


class MemoryTier:
    def __init__(self, config: Any) -> None:
        self.config = config
        self.run_id = run_id_of(config.folder)
        self.fingerprint = str(config.fingerprint or "")
        self.namespace = str(config.memory_namespace)
        self._use(self._start_holders(_alive_nodes()))
        self.saves = 0
        self._recent: list[int] | None = None  # memory steps for retention (None: list them)
        self._persisting: asyncio.Task | None = None
        self._checked_nodes = time.monotonic()
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
        self.spec = StorageSpec(f"mem://{self.run_id}", options)
        self.store: MemoryStorage = open_storage(self.spec)  # type: ignore[assignment]
        self.holders: list[HolderRef] = holders

    def add_new_nodes(self, every_s: float = 2.0) -> list[str]:
        """Start holders on nodes that joined since (a replacement for a lost node), at most
        every `every_s`; the next save places copies on them too. Their ids, if any."""
        if time.monotonic() - self._checked_nodes < every_s:
            return []
        self._checked_nodes = time.monotonic()
        known = {node for _, node in self.holders}
        new = [n for n in _alive_nodes() if n not in known]
        if new:
            self._use([*self.holders, *self._start_holders(new)])
            log.info("memory tier: holders started on new nodes %s", [n[:8] for n in new])
        return new

    # ---- holders -----------------------------------------------------------------------
    def _start_holders(self, nodes: list[str]) -> list[HolderRef]:
        if not ray.is_initialized():
            raise CheckpointError("the memory tier needs Ray: call ray.init() first")
        refs = []
        for node in nodes:
            name = holder_name(self.run_id, node)
            self._retire_foreign(name)
            try:
                ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                self._create(name, node)
            refs.append((name, node))
        cfg = self.config
        for name, _ in refs:  # every holder answers (with our budget) before the first save
            h = ray.get_actor(name, namespace=self.namespace)
            ray.get(h.configure.remote(cfg.memory_budget_bytes, cfg.memory_keep), timeout=60)
        return refs

    def _retire_foreign(self, name: str) -> None:
        """Kill a holder of this folder left by a run with another fingerprint."""
        try:
            old = ray.get_actor(name, namespace=self.namespace)
            info = ray.get(old.info.remote(), timeout=30)
        except (ValueError, ray.exceptions.RayActorError):
            return
        if info["fingerprint"] == self.fingerprint:
            return
        log.warning("retiring memory holder %s of another run (fingerprint %r, ours %r)",
                    name, info["fingerprint"], self.fingerprint)  # fmt: skip
        ray.kill(old, no_restart=True)
        forget(self.namespace, name)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the name is released asynchronously
            try:
                ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                return
            time.sleep(0.05)
        raise CheckpointError(f"memory holder {name} did not go away after ray.kill")

    def _create(self, name: str, node: str) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cfg = self.config
        HolderActor.options(
            name=name,
            namespace=self.namespace,
            lifetime="detached",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(self.run_id, self.fingerprint, cfg.memory_budget_bytes, cfg.memory_keep)

    def shutdown(self) -> None:
        """Kill this run's holders (their copies are gone): for a run that is over."""
        for name, _ in self.holders:
            try:
                ray.kill(ray.get_actor(name, namespace=self.namespace), no_restart=True)
            except ValueError:
                continue

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
            alive = set(_alive_nodes())
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
    ) -> None:
        """Memory retention; the step also goes to the durable folder if `due` (default:
        every `durable_every`-th save), in the background (one persist at a time; `flush()`
        raises its error). `persist`: the coordinator's commit and durable retention."""
        commit_fn, retention = persist
        await asyncio.to_thread(self._retention, manifest.step)
        await asyncio.to_thread(self.add_new_nodes)
        self.saves += 1
        if not (self.saves % self.config.durable_every == 0 if due is None else due):
            return
        if self._persisting is not None:  # one at a time; a failed one was logged, and this
            await asyncio.wait([self._persisting])  # newer step supersedes it

        async def run() -> None:
            await self.persist(manifest, durable, self.config.storage, commit_fn)
            await retention()

        self._persisting = asyncio.create_task(run())
        self._persisting.add_done_callback(_log_failure)

    def _retention(self, step: int) -> None:
        """Drop the memory steps beyond `memory_keep`. The steps are listed once; after that
        this tier's own commits are the list (a step lost with its holders is dropped again
        harmlessly), which saves a listing and two reads per step at every save."""
        if self._recent is None:
            self._recent = self.steps()
        self._recent = sorted({*self._recent, step})
        keep = commit.RetentionPolicy(keep_last=self.config.memory_keep)
        for old in keep.to_delete(self._recent):
            commit.remove_step(self.store, old)
            self._recent.remove(old)

    def relist(self) -> None:
        """The steps changed other than by our commits (a load may retire a branch)."""
        self._recent = None

    async def flush(self) -> None:
        """Wait for a persist in flight; raises its error."""
        task, self._persisting = self._persisting, None
        if task is not None:
            await task

    def cancel(self) -> None:
        if self._persisting is not None and not self._persisting.done():
            log.warning("closing while persisting a memory step: it will not be durable")
            self._persisting.cancel()

    # ---- persisting --------------------------------------------------------------------
    async def persist(
        self,
        manifest: layout.Manifest,
        durable: Storage,
        durable_spec: StorageSpec,
        commit_fn: Callable[[layout.Manifest], None],
    ) -> None:
        """Copy a committed memory step to the durable folder (each holder writes the files
        it holds), then commit it there with the same manifest."""
        step, name = manifest.step, layout.step_name(manifest.step)
        if step in await asyncio.to_thread(layout.committed_steps, durable):
            return
        await asyncio.to_thread(commit.prepare_step, durable, step)
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
            await asyncio.to_thread(commit_fn, manifest)
        except BaseException:
            await asyncio.to_thread(commit.remove_step, durable, step)
            raise
        log.info("persisted memory step %d to %s", step, durable.where(name))

    async def _holders_write(self, manifest: layout.Manifest, spec: StorageSpec) -> list:
        """Each file is written by one live holder that has it, holders in parallel."""
        prefix = layout.step_name(manifest.step)
        keys = [f"{prefix}/{f.path}" for f in manifest.files]
        has = await asyncio.to_thread(self.store.on_all, "has", keys)
        jobs: dict[HolderRef, list[tuple[str, str]]] = {}
        for i, (f, key) in enumerate(zip(manifest.files, keys, strict=True)):
            owner = next((ref for ref, flags in has if flags[i]), None)
            if owner is None:
                raise CheckpointError(f"persisting step {manifest.step}: {key} has no copy left")
            jobs.setdefault(owner, []).append((key, f.path))
        calls = [self.store.handle(ref[0]).persist.remote(spec, job) for ref, job in jobs.items()]
        results = await asyncio.gather(*calls)
        return [FileRecord.from_dict(r) for rs in results for r in rs]


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("persisting a memory step failed (raised by the next wait()): %s",
                  task.exception())  # fmt: skip
