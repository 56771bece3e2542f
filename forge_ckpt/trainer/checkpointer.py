"""The trainer side: the state TorchTitan's `CheckpointManager` builds, written as standard DCP
shards into our `step-N/` through our own DCP storage writer (local disk or S3).

Each trainer rank (one Ray actor per rank, one gloo/NCCL process group between them) holds a
`TrainerCheckpointer`. It saves exactly the state dict TorchTitan itself saves (the manager's
`states`: model keys flattened as TorchTitan flattens them, `optimizer`, `lr_scheduler`,
`dataloader`, extra `states`) with `dcp.save`/`dcp.load` and `dcp_io`'s writer and reader, to
the explicit folder the coordinator created. The DCP files sit directly in `step-N/`, so stock
TorchTitan `CheckpointManager(folder=<our folder>).load(step=N)` restores model, optimizer and
LR schedule from a local folder (build it with `dataloader=None`, or with
`exclude_from_loading=["dataloader"]`: the data position is not the trainer's state here).
TorchTitan's step naming, purge and "latest" discovery are never used.

Next to its DCP shard each rank writes `trainer/rank-<r>.msgpack` (RNG streams, rank, world
size: state DCP does not hold), with `forge_ckpt.serialization`, never pickle. Every file's
CRC32C is computed while it is written (no read-back).

Load verifies (unless the caller turns it off) before DCP opens anything, and `.metadata` is
unpickled only through an allowlist (`dcp_metadata`), so a hostile file cannot run code.

`TrainerMixin` gives a Ray trainer actor the protocol the coordinator speaks;
`spawn_trainer_ranks` starts the rank actors and their process group.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torchtitan.components.checkpointer import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    CheckpointManager,
)
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer

from .. import serialization
from ..actors import rng
from ..dcp.metadata import check_complete, load_metadata
from ..dcp.reader import FileIdentity
from ..dcp.storage_io import (
    METADATA,
    SavePlanner,
    SeamReader,
    SeamWriter,
    alone,
    misfits,
    verify_local,
)
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from ..steps import layout
from ..storage import FileRecord, Storage, StorageSpec, open_storage
from .staging import SnapshotBuffers

log = logging.getLogger("forge_ckpt")

RANK_FILE_FORMAT = 1
DCP_METADATA = METADATA  # written by DCP's coordinator rank (rank 0)
_SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclass
class _StagedLoad:
    store: Storage
    load_optimizer: bool
    rank_state: dict[str, Any] | None
    expected: dict[str, FileRecord]
    cache: dict[str, bytes | bytearray]
    seen: dict[str, FileIdentity]  # local files verified in prepare, as they were then


def flat_state(states: dict[str, Any]) -> dict[str, Any]:
    """The state dict TorchTitan's manager saves: its `states`, with the model wrapper's keys
    flattened into the top level (so the files are what stock TorchTitan writes and reads)."""
    sd = {k: v for k, v in states.items() if k != MODEL}
    if MODEL in states:
        sd.update(states[MODEL].state_dict())
    return sd


class TrainerCheckpointer:
    """Checkpointing for one trainer rank; every method is called by all ranks together."""

    def __init__(
        self,
        *,
        model_parts: list[nn.Module],
        optimizers: OptimizersContainer,
        lr_schedulers: LRSchedulersContainer,
        states: dict[str, Stateful] | None = None,
        rng_generators: dict[str, rng.Generator] | None = None,
        write_threads: int = 2,
    ) -> None:
        if not dist.is_initialized():
            raise CheckpointError(
                "TrainerCheckpointer needs torch.distributed initialized first (one process "
                "group per trainer, also with one rank): use spawn_trainer_ranks()"
            )
        reserved = sorted(set(states or {}) & {MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER})
        if reserved:
            raise ValueError(f"states may not use TorchTitan's own keys {reserved}")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.lr_schedulers = lr_schedulers
        self._optimizers = optimizers
        self._generators = dict(rng_generators or {})
        # folder is never used: every save and load names its step folder explicitly, and
        # keep_latest_k=0 keeps TorchTitan's purge thread (which deletes step-N by name) off;
        # initial_load_model_only=False: we never use its initial load (it warns otherwise).
        self.manager = CheckpointManager.Config(
            enable=True,
            folder="unused-by-forge-ckpt",
            keep_latest_k=0,
            initial_load_model_only=False,
        ).build(
            dataloader=None,
            model_parts=model_parts,
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            states=dict(states or {}),  # TorchTitan adds its own keys to this dict
            sd_adapter=None,
        )
        self._save_pg: dist.ProcessGroup | None = None
        self._snapshot = SnapshotBuffers()
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future | None = None
        self._records: list[dict] | None = None
        self._staged: _StagedLoad | None = None
        self._aborted: Future | None = None
        self.write_threads = write_threads
        self._copied = threading.Event()  # clear while a deferred snapshot copy runs
        self._copied.set()
        self.stall_s = 0.0  # total time optimizer steps waited for a deferred copy
        self._hook = register_optimizer_step_pre_hook(self._before_step(optimizers))

    def _before_step(self, optimizers: OptimizersContainer) -> Callable[..., None]:
        """A global pre-step hook: it runs before the optimizers' own pre-step hooks (one of
        TorchTitan's changes MoE biases), for this trainer's container and its optimizers."""
        mine = {id(optimizers), *(id(o) for o in getattr(optimizers, "optimizers", []))}

        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if id(opt) in mine:
                self.wait_for_snapshot()

        return hook

    # ---- save -------------------------------------------------------------------------------

    def begin_save(
        self, where: StorageSpec | str, background: bool = False, defer: bool = False
    ) -> int:
        """Take the snapshot; write it now (sync) or in a thread (background).

        Returns the snapshot's size in bytes (this rank's tensors and rank file). In background
        mode the snapshot is a CPU copy made before returning (buffers reused between saves),
        so the training step that follows cannot change what is written. With `defer` the
        copy runs in the writer thread too, and the next optimizer step (or load) waits for
        it first (`wait_for_snapshot`): the cut stays exact and the loop stalls only if the
        copy takes longer than what runs before that step (a rollout, forward and backward).
        """
        self._join_aborted()
        if self._future is not None:
            raise CheckpointError(
                f"trainer rank {self.rank}: a background save is still running; wait for "
                "save_status() to return the files before starting the next save"
            )
        self._records = None
        store = open_storage(where)
        state = _resolve(flat_state(self.manager.states))
        name = f"trainer rank {self.rank}"
        rank_snap = serialization.snapshot(self._rank_state(), name=name, copy=background)
        if not background:
            self._records = self._write(store, state, rank_snap, None)
            return _tensor_bytes(state) + rank_snap.nbytes
        pg = self._background_pg()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="forge-ckpt-trainer")
        if defer:
            self._copied.clear()
            self._future = self._executor.submit(self._copy_and_write, store, state, rank_snap, pg)
            return _tensor_bytes(state) + rank_snap.nbytes
        staged = self._stage(state)
        self._future = self._executor.submit(self._write, store, staged, rank_snap, pg)
        return _tensor_bytes(staged) + rank_snap.nbytes

    def _copy_and_write(
        self,
        store: Storage,
        state: dict[str, Any],
        rank_snap: serialization.Snapshot,
        pg: dist.ProcessGroup,
    ) -> list[dict]:
        try:
            staged = self._stage(state)
        finally:
            self._copied.set()  # a failed copy fails the save; it must not block training
        return self._write(store, staged, rank_snap, pg)

    def wait_for_snapshot(self) -> float:
        """Block until a deferred snapshot copy is complete (called before anything changes
        the weights or the optimizer state); the seconds waited, added to `stall_s`."""
        if self._copied.is_set():
            return 0.0
        t0 = time.perf_counter()
        self._copied.wait()
        waited = time.perf_counter() - t0
        self.stall_s += waited
        return waited

    def save_status(self) -> list[dict] | None:
        """None while a background save runs; then this rank's FileRecord dicts (paths relative
        to the step folder). A failed background write is raised here, never dropped."""
        if self._future is not None:
            if not self._future.done():
                return None
            future, self._future = self._future, None
            self._records = future.result()  # re-raises the writer's exception
        if self._records is None:
            raise CheckpointError(f"trainer rank {self.rank}: no save was begun")
        return self._records

    def abort_save(self, timeout_s: float = 60.0) -> bool:
        """The step failed elsewhere: join this rank's background write (bounded) and forget
        it, so that the next save and load find the rank idle. True if nothing still runs."""
        self._records = None
        future, self._future = self._future, None
        if future is None:
            return True
        try:
            future.result(timeout=timeout_s)
        except TimeoutError:
            # Stuck (a collective waiting for a rank that died): the next save waits for it.
            self._aborted = future
            return False
        except BaseException as e:  # the save is abandoned: its error no longer matters
            log.info("trainer rank %d: aborted background write ended with %s", self.rank, e)
        return True

    def _join_aborted(self) -> None:
        if self._aborted is None:
            return
        if not self._aborted.done():
            raise CheckpointError(
                f"trainer rank {self.rank}: the background write of an aborted save is still "
                "running (a collective waiting for a rank that died?); restart the trainer"
            )
        self._aborted = None

    def _rank_state(self) -> dict[str, Any]:
        return {
            "format": RANK_FILE_FORMAT,
            "rank": self.rank,
            "world_size": self.world_size,
            "rng": rng.capture(self._generators),
        }

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """Copy the state into CPU memory that training cannot touch (pinned for a GPU
        trainer); the buffers are kept, so later saves copy without allocating."""
        return self._snapshot.copy(state)

    def _background_pg(self) -> dist.ProcessGroup:
        """A gloo group of our own, as TorchTitan's async mode makes: the background DCP
        collectives never interleave with training collectives on the default group."""
        if self._save_pg is None:
            self._save_pg = dist.new_group(backend="gloo")
        return self._save_pg

    def _write(
        self,
        store: Storage,
        state: dict[str, Any],
        rank_snap: serialization.Snapshot,
        pg: dist.ProcessGroup | None,
    ) -> list[dict]:
        store.makedirs(layout.TRAINER)  # the coordinator made it; a bare DCP user may not
        writer = SeamWriter(store, thread_count=self.write_threads)
        with _dcp_errors(self.rank):
            dcp.save(state, storage_writer=writer, planner=SavePlanner(), process_group=pg,
                     no_dist=alone(pg))  # fmt: skip
        relpath = layout.trainer_rank_file(self.rank)
        records = [*writer.records, rank_snap.write_to(store, relpath)]
        store.sync_dir(layout.TRAINER)
        store.sync_dir("")
        return [r.to_dict() for r in records]

    # ---- load -------------------------------------------------------------------------------

    def prepare_load(
        self,
        where: StorageSpec | str,
        records: list[dict],
        *,
        verify: bool,
        load_optimizer: bool = True,
        rank_file: str | None,
        saved_rank: int | None = None,
    ) -> None:
        """Verify files, decode this rank's file, and check that everything fits this
        trainer (every tensor's shape, dtype and kind against `.metadata`; the RNG streams'
        names and kinds), so that the apply cannot fail on a mismatch; changes nothing.

        Every rank checks `.metadata` and its own rank file; the shards are split among ranks
        (the shards rank r wrote are checked by rank r % world_size, which with an unchanged
        world size is the rank that reads them). Verified bytes of an object store are kept
        for the load, so nothing is downloaded twice; a local shard is checked here (to refuse
        early) and again as the apply reads it, so a file replaced in between is refused, never
        loaded. No collectives: a rank that fails raises, and the coordinator aborts the load
        on every rank.
        """
        self._join_aborted()
        if self._future is not None:
            raise CheckpointError(f"trainer rank {self.rank}: cannot load during a save")
        self._staged = None
        store = open_storage(where)
        recs = {r["path"]: FileRecord.from_dict(r) for r in records}
        for path in recs:
            layout.check_relpath(path, store.where(layout.MANIFEST))
        cache, seen, metadata = self._verify(store, recs, verify)
        self._check_fits(metadata, load_optimizer, store.where(DCP_METADATA))
        rank_state = None
        if rank_file is not None:
            rank_state = self._read_rank_file(store, recs, verify, rank_file, saved_rank)
        # Every file DCP reads is checked again as it is read, unless its verified bytes are
        # held here or it is provably the file verified here (same inode, size, mtime and
        # ctime): a file replaced or rewritten after this check is never loaded unseen.
        unchecked = {p: r for p, r in recs.items() if p not in cache} if verify else {}
        self._staged = _StagedLoad(store, load_optimizer, rank_state, unchecked, cache, seen)

    def _read_rank_file(
        self,
        store: Storage,
        recs: dict[str, FileRecord],
        verify: bool,
        rank_file: str,
        saved_rank: int | None,
    ) -> dict[str, Any]:
        """This rank's saved RNG streams, checked to fit this rank's generators."""
        if verify and rank_file not in recs:
            raise CheckpointCorruptError(store.where(rank_file), "not listed in the manifest")
        rank_rec = recs.get(rank_file) if verify else None
        rank_state = serialization.load_from(store, rank_file, rank_rec)
        want = self.rank if saved_rank is None else saved_rank
        if rank_state.get("rank") != want:
            raise CheckpointMismatchError(
                [
                    f"{store.where(rank_file)} holds rank {rank_state.get('rank')}, "
                    f"expected rank {want} (loaded by rank {self.rank})"
                ]  # fmt: skip
            )
        problems = rng.differences(rank_state.get("rng"), self._generators)
        if problems:
            raise CheckpointMismatchError(
                [f"{store.where(rank_file)}: {p}" for p in problems],
                "pass the same rng_generators to TrainerCheckpointer as the run that saved, "
                "or load(exclude=['trainer']); nothing was applied",
            )
        if want != self.rank:  # an added rank: distinct streams derived from `want`'s
            log.info("trainer rank %d derives its RNG streams from saved rank %d's "
                     "(world size changed; rng.derive)", self.rank, want)  # fmt: skip
            rank_state = {**rank_state, "rng": rng.derive(rank_state["rng"], self.rank)}
        return rank_state

    def _check_fits(self, metadata: Metadata, load_optimizer: bool, where: str) -> None:
        """Refuse, before any component is applied, what DCP would refuse only halfway through
        the apply: a tensor the checkpoint lacks, or of another shape, dtype or kind. A fresh
        optimizer has no state tensors until its first step: TorchTitan's state_dict() makes
        them with a zero step, which is undone here (the apply makes them again)."""
        fresh = [o for o in self._optimizers.optimizers if not o.state] if load_optimizer else []
        try:
            problems = misfits(_resolve(self._load_targets(load_optimizer)), metadata)
        finally:
            for opt in fresh:
                opt.state.clear()
        if problems:
            raise CheckpointMismatchError(
                [f"{where}: {p}" for p in problems],
                "build the model and optimizer as the run that saved did (or reshard the "
                "checkpoint offline), or load(exclude=['optimizer']) if only the optimizer "
                "differs; nothing was applied",
            )

    def _load_targets(self, load_optimizer: bool) -> dict[str, Any]:
        """The state dict DCP loads into (its Stateful values not yet resolved)."""
        states = self.manager.states
        return flat_state({k: v for k, v in states.items() if load_optimizer or k != OPTIMIZER})

    def _verify(
        self, store: Storage, recs: dict[str, FileRecord], verify: bool
    ) -> tuple[dict[str, bytes | bytearray], dict[str, FileIdentity], Metadata]:
        """Check `.metadata` and this rank's share of the shards; returns the bytes to hold
        for the apply (always `.metadata`; on an object store, the verified shards too, so
        nothing is downloaded twice), the identities of the local shards checked, and the
        decoded metadata."""
        if verify and DCP_METADATA not in recs:
            raise CheckpointCorruptError(store.where(DCP_METADATA), "not listed in the manifest")
        # DCP's metadata is opened here, through the allowlist: a planted pickle is refused
        # before anything is applied, and never runs. The apply reads these very bytes.
        meta = store.read_verified(DCP_METADATA, recs.get(DCP_METADATA) if verify else None)
        cache: dict[str, bytes | bytearray] = {DCP_METADATA: meta}
        metadata = load_metadata(meta, store.where(DCP_METADATA))
        seen: dict[str, FileIdentity] = {}
        if not verify:
            return cache, seen, metadata
        check_complete(metadata, recs, store.where(DCP_METADATA))
        keep = store.local_path() is None  # an object store: keep what was downloaded
        for path in (p for p in sorted(recs) if self._checks(p)):
            if keep:
                cache[path] = store.read_verified(path, recs[path])
            else:  # checked now to refuse early; checked again as read only if it changed
                ident = verify_local(store, path, recs[path])
                if ident is not None:
                    seen[path] = ident
        return cache, seen, metadata

    def _checks(self, path: str) -> bool:
        m = _SHARD_RE.match(path)
        return m is not None and int(m.group(1)) % self.world_size == self.rank

    def apply_load(self) -> None:
        """Load the prepared step into model, optimizer (unless excluded), LR schedule and
        states with DCP (a collective), then restore this rank's RNG streams."""
        self.wait_for_snapshot()  # the load must not change what a deferred copy reads
        staged = self._staged
        if staged is None:
            raise CheckpointError(f"trainer rank {self.rank}: apply_load without prepare_load")
        self._staged = None
        states = self.manager.states
        sd = self._load_targets(staged.load_optimizer)
        reader = SeamReader(staged.store, staged.expected, staged.cache, seen=staged.seen)
        with _dcp_errors(self.rank):
            dcp.load(sd, storage_reader=reader)
        if MODEL in states:  # DCP filled the flattened model tensors; hand them to the model
            states[MODEL].load_state_dict(sd)
        if not staged.load_optimizer:
            self._lr_to_optimizer()
        if staged.rank_state is None:
            log.info(
                "trainer rank %d: no rank file (world size changed?): RNG not restored", self.rank
            )
        else:
            rng.restore(staged.rank_state["rng"], self._generators)  # fits: checked in prepare

    def _lr_to_optimizer(self) -> None:
        """A fresh optimizer keeps its initial LR until the scheduler's next step; give it the
        restored schedule's LR now, as a loaded optimizer would have."""
        for scheduler in self.lr_schedulers:
            for group, lr in zip(
                scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True
            ):
                group["lr"] = lr

    def abort_load(self) -> None:
        self._staged = None

    def close(self) -> None:
        """Wait for a background write and release the save thread, hook and process group."""
        self._hook.remove()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._save_pg is not None:
            dist.destroy_process_group(self._save_pg)
            self._save_pg = None


@contextmanager
def _dcp_errors(rank: int) -> Generator[None, None, None]:
    """DCP wraps every rank's failure in a CheckpointException (a BaseException, which
    `except Exception` misses); raise this rank's own error, or the first rank's, instead."""
    try:
        yield
    except CheckpointException as e:
        failures = e.failures
        exc, _ = failures.get(rank) or next(iter(failures.values()), (None, None))
        if isinstance(exc, Exception):
            raise exc from None
        raise CheckpointError(f"trainer rank {rank}: DCP failed: {e}") from None


def _resolve(state: dict[str, Any]) -> dict[str, Any]:
    """Call `state_dict()` on top-level Stateful values, as `dcp.save` does itself (so the
    files are the same); the snapshot then copies plain containers and tensors."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, DTensor):
        return obj._local_tensor.nbytes
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0
