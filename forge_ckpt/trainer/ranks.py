"""The Ray side of a trainer rank: `TrainerMixin` speaks the coordinator's protocol by
delegating to the rank's `TrainerCheckpointer`, and `spawn_trainer_ranks` starts the rank
actors and joins them in one gloo process group (the rendezvous is a collective: all ranks at
once)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..storage import StorageSpec
from .checkpointer import TrainerCheckpointer


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

    def forge_begin_save(
        self, where: StorageSpec, relpath: str, background: bool, defer: bool = False
    ) -> dict:
        """The snapshot's size and, after a synchronous write, this rank's file records."""
        del relpath  # trainer ranks name their own files
        nbytes = self.checkpointer.begin_save(where, background, defer)
        files = None if background else self.checkpointer.save_status()
        return {"nbytes": nbytes, "files": files}

    def forge_save_status(self) -> list[dict] | None:
        return self.checkpointer.save_status()

    def forge_abort_save(self, timeout_s: float = 60.0) -> bool:
        return self.checkpointer.abort_save(timeout_s)

    def forge_prepare_load(
        self, where: StorageSpec, records: list[dict], verify: bool, options: dict
    ) -> None:
        self.checkpointer.prepare_load(
            where,
            records,
            verify=verify,
            load_optimizer=options.get("load_optimizer", True),
            rank_file=options.get("rank_file"),
            saved_rank=options.get("saved_rank"),
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
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{host}:{port}",
            timeout=None if timeout_s is None else timedelta(seconds=timeout_s),  # None: default
            rank=rank,
            world_size=world_size,
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
