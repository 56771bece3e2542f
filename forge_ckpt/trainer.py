"""The trainer side: TorchTitan's `CheckpointManager` writing DCP shards into our `step-N/`.

Each trainer rank (one Ray actor per rank, one gloo/NCCL process group between them) holds a
`TrainerCheckpointer`. It saves exactly the state dict TorchTitan itself saves (model keys
flattened, `optimizer`, `lr_scheduler`, `dataloader`, extra `states`) with TorchTitan's public
`dcp_save`/`dcp_load`, but to the explicit folder the coordinator created. The DCP files sit
directly in `step-N/`, so stock TorchTitan `CheckpointManager(folder=<our folder>).load(step=N)`
restores model, optimizer and LR schedule from it (build it with `dataloader=None`, or with
`exclude_from_loading=["dataloader"]`: the data position is not the trainer's state here, so the
saved `dataloader` entry is None). TorchTitan's step naming, purge and "latest" discovery are
never used: the coordinator's manifest and marker decide what exists.

Next to its DCP shard each rank writes `trainer/rank-<r>.msgpack` (RNG streams, rank, world
size: state DCP does not hold), with `forge_ckpt.serialization`, never pickle.

DCP fsyncs every file it writes (`FileSystemWriter(sync_files=True)`, `.metadata` via fsync +
rename) but not the folder, so we fsync the folders. DCP writes its own files, so their crc32c
is computed by reading them back after the write (from the page cache, right after writing).

Load verifies (unless the caller turns it off) before DCP opens anything: `.metadata` is a
pickle and must never be unpickled unless it is byte-for-byte the file we wrote.

`TrainerMixin` gives a Ray trainer actor the protocol the coordinator speaks;
`spawn_trainer_ranks` starts the rank actors and their process group.
"""

from __future__ import annotations

import glob
import logging
import os
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpoint import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    AsyncMode,
    CheckpointManager,
)
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer

from . import layout, rng, serialization
from .errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from .staging import SnapshotBuffers
from .storage import FileRecord, checksum_file, fsync_dir, verify_file

log = logging.getLogger("forge_ckpt")

RANK_FILE_FORMAT = 1
DCP_METADATA = ".metadata"  # written by DCP's coordinator rank (rank 0)


@dataclass
class _StagedLoad:
    step_dir: str
    load_optimizer: bool
    rank_state: dict[str, Any] | None


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

    # ---- save -------------------------------------------------------------------------------

    def begin_save(self, step_dir: str, background: bool = False) -> int:
        """Take the snapshot; write it now (sync) or in a thread (background).

        Returns the snapshot's size in bytes (this rank's tensors and rank file). In background
        mode the
        snapshot is a CPU copy made before returning (buffers reused between saves), so the
        training step that follows cannot change what is written.
        """
        if self._future is not None:
            raise CheckpointError(
                f"trainer rank {self.rank}: a background save is still running; wait for "
                "save_status() to return the files before starting the next save"
            )
        self._records = None
        os.makedirs(os.path.join(step_dir, layout.TRAINER), exist_ok=True)
        state = _resolve(self.manager._flattened_model_states_sd())
        name = f"trainer rank {self.rank}"
        rank_snap = serialization.snapshot(self._rank_state(), name=name, copy=background)
        if not background:
            self._records = self._write(step_dir, state, rank_snap, None)
            return _tensor_bytes(state) + rank_snap.nbytes
        staged = self._stage(state)
        pg = self._background_pg()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="forge-ckpt-trainer")
        self._future = self._executor.submit(self._write, step_dir, staged, rank_snap, pg)
        return _tensor_bytes(staged) + rank_snap.nbytes

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
        step_dir: str,
        state: dict[str, Any],
        rank_snap: serialization.Snapshot,
        pg: dist.ProcessGroup | None,
    ) -> list[dict]:
        if pg is None:
            self.manager.dcp_save(state, checkpoint_id=step_dir, async_mode=AsyncMode.DISABLED)
        else:
            dcp.save(state, checkpoint_id=step_dir, process_group=pg)
        relpath = layout.trainer_rank_file(self.rank)
        rank_record = rank_snap.write(os.path.join(step_dir, relpath), relpath)
        records = [_record(step_dir, name) for name in self._dcp_files(step_dir)]
        records.append(rank_record)
        fsync_dir(os.path.join(step_dir, layout.TRAINER))
        fsync_dir(step_dir)
        return [r.to_dict() for r in records]

    def _dcp_files(self, step_dir: str) -> list[str]:
        """The DCP files this rank wrote: its `__<rank>_<n>.distcp` shards (DCP prefixes each
        rank's files with its rank), and `.metadata` on the coordinator rank."""
        pattern = os.path.join(glob.escape(step_dir), f"__{self.rank}_*.distcp")
        names = sorted(os.path.basename(p) for p in glob.glob(pattern))
        if self.rank == 0:
            names.append(DCP_METADATA)
        return names

    # ---- load -------------------------------------------------------------------------------

    def prepare_load(
        self,
        step_dir: str,
        records: list[dict],
        *,
        verify: bool,
        load_optimizer: bool = True,
        rank_file: str | None,
    ) -> None:
        """Verify files and decode this rank's file; changes nothing in the trainer.

        Every rank checks `.metadata` (each rank's DCP unpickles it) and its own rank file; the
        shards are split among ranks (shard i by rank i % world_size). No collectives: a rank
        that fails raises, and the coordinator aborts the load on every rank.
        """
        if self._future is not None:
            raise CheckpointError(f"trainer rank {self.rank}: cannot load during a save")
        self._staged = None
        recs = {r["path"]: FileRecord.from_dict(r) for r in records}
        if verify:
            self._verify(step_dir, recs)
        rank_state = None
        if rank_file is not None:
            path = os.path.join(step_dir, rank_file)
            if verify and rank_file not in recs:
                raise CheckpointCorruptError(path, "not listed in the manifest")
            rank_state = serialization.load(path, recs.get(rank_file) if verify else None)
            if rank_state.get("rank") != self.rank:
                raise CheckpointMismatchError(
                    [f"{path} holds rank {rank_state.get('rank')}, loaded by rank {self.rank}"]
                )
        self._staged = _StagedLoad(step_dir, load_optimizer, rank_state)

    def _verify(self, step_dir: str, recs: dict[str, FileRecord]) -> None:
        if DCP_METADATA not in recs:
            raise CheckpointCorruptError(
                os.path.join(step_dir, DCP_METADATA), "not listed in the manifest"
            )
        verify_file(os.path.join(step_dir, DCP_METADATA), recs[DCP_METADATA])
        shards = sorted(p for p in recs if p.endswith(".distcp"))
        for i, name in enumerate(shards):
            if i % self.world_size == self.rank:
                verify_file(os.path.join(step_dir, name), recs[name])

    def apply_load(self) -> None:
        """Load the prepared step into model, optimizer (unless excluded), LR schedule and
        states with DCP (a collective), then restore this rank's RNG streams."""
        staged = self._staged
        if staged is None:
            raise CheckpointError(f"trainer rank {self.rank}: apply_load without prepare_load")
        self._staged = None
        states = self.manager.states
        keys = [k for k in states if staged.load_optimizer or k != OPTIMIZER]
        sd = self.manager._flattened_model_states_sd({k: states[k] for k in keys})
        self.manager.dcp_load(
            sd, checkpoint_id=staged.step_dir, from_hf=False, from_quantized=False
        )
        if not staged.load_optimizer:
            self._lr_to_optimizer()
        if staged.rank_state is None:
            log.info(
                "trainer rank %d: no rank file (world size changed?): RNG not restored", self.rank
            )
        else:
            rng.restore(staged.rank_state["rng"], self._generators)

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
        """Wait for a background write and release the save thread and process group."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._save_pg is not None:
            dist.destroy_process_group(self._save_pg)
            self._save_pg = None


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


def _record(step_dir: str, relpath: str) -> FileRecord:
    rec = checksum_file(os.path.join(step_dir, relpath))
    return FileRecord(path=relpath, size=rec.size, crc32c=rec.crc32c)


class TrainerMixin:
    """Mixin for a Ray trainer actor: the forge protocol, delegated to `self.checkpointer`.

    The actor creates `self.checkpointer = TrainerCheckpointer(...)` in its own setup, after
    `spawn_trainer_ranks` has initialized the process group.
    """

    checkpointer: TrainerCheckpointer

    def forge_world_info(self) -> dict[str, int]:
        if not dist.is_initialized():
            return {"rank": 0, "world_size": 1}
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size()}

    def forge_begin_save(self, step_dir: str, relpath: str, background: bool) -> dict:
        """The snapshot's size and, after a synchronous write, this rank's file records."""
        del relpath  # trainer ranks name their own files
        nbytes = self.checkpointer.begin_save(step_dir, background)
        files = None if background else self.checkpointer.save_status()
        return {"nbytes": nbytes, "files": files}

    def forge_save_status(self) -> list[dict] | None:
        return self.checkpointer.save_status()

    def forge_prepare_load(
        self, step_dir: str, records: list[dict], verify: bool, options: dict
    ) -> None:
        self.checkpointer.prepare_load(
            step_dir,
            records,
            verify=verify,
            load_optimizer=options.get("load_optimizer", True),
            rank_file=options.get("rank_file"),
        )

    def forge_apply_load(self) -> None:
        self.checkpointer.apply_load()

    def forge_abort_load(self) -> None:
        self.checkpointer.abort_load()

    def forge_free_endpoint(self) -> tuple[str, int]:
        """This node's address and a free TCP port for the rendezvous (rank 0 is asked)."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def forge_init_distributed(
        self, rank: int, world_size: int, addr: str, port: int, timeout_s: float | None = None
    ) -> None:
        """Join the trainer's gloo process group (a rendezvous: all ranks at once)."""
        host = f"[{addr}]" if ":" in addr else addr
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
        kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=rank,
            world_size=world_size,
            **kwargs,
        )


def spawn_trainer_ranks(actor_cls: Any, world_size: int, *args: Any, **kwargs: Any) -> list:
    """Start `world_size` rank actors of a `@ray.remote` TrainerMixin class (or its
    `.options(...)`) and join them in one process group; returns the handles in rank order.

    The init calls are gathered, never sequential: the rendezvous waits for every rank.
    """
    import ray

    actors = [actor_cls.remote(*args, **kwargs) for _ in range(world_size)]
    ranks = list(enumerate(actors))
    try:
        addr, port = ray.get(actors[0].forge_free_endpoint.remote())
        ray.get([a.forge_init_distributed.remote(r, world_size, addr, port) for r, a in ranks])
    except BaseException:
        for a in actors:
            ray.kill(a)
        raise
    return actors
