"""The state sweep: a trainer and 4 actors at one total state size, against the baselines
measured in the same trial (raw disk, torch.save, TorchTitan alone)."""

from __future__ import annotations

import logging
import time
from typing import Any

from forge_ckpt import CheckpointCoordinator
from forge_ckpt.steps import layout

from . import disk
from .experiments import (
    SWEEP_ACTORS,
    TRAINER_SHARE,
    Bench,
    coordinator,
    forge_load,
    forge_save,
    run_trials,
    size_actors,
)

log = logging.getLogger("benchmarks")
MiB = disk.MiB


class StateMethods:
    """The methods compared at one state size; each returns what it measured."""

    def __init__(
        self, b: Bench, label: str, nbytes: int, full: CheckpointCoordinator, tonly: Any
    ) -> None:
        self.b, self.label, self.nbytes = b, label, nbytes
        self.full, self.tonly = full, tonly
        self.everyone = [b.trainer, *b.pool[:SWEEP_ACTORS]]

    def methods(self) -> list:
        return [
            ("raw", self.raw),
            ("torch_save", self.torch_save),
            ("titan_sync", self.titan_sync),
            ("titan_async", self.titan_async),
            ("forge_trainer_sync", lambda: forge_save(self.b, self.tonly, [self.b.trainer], "sync")),
            ("forge_trainer_async", lambda: forge_save(self.b, self.tonly, [self.b.trainer], "async")),
            ("forge_full_sync", self.forge_full_sync),
            ("forge_full_async", lambda: forge_save(self.b, self.full, self.everyone, "async")),
        ]  # fmt: skip

    async def raw(self) -> dict:
        raw_file = self.b.path(f"raw-{self.label}.bin")
        w = disk.python_write(raw_file, self.nbytes)
        dd = disk.dd_write(raw_file + ".dd", self.nbytes)
        disk.remove(raw_file + ".dd")
        r = disk.cold_read(raw_file, self.b.cache)
        disk.remove(raw_file)
        out = {"write_s": w, "read_s": r, "bytes": self.nbytes}
        if dd is not None:
            out["dd_s"], out["dd_bytes"] = dd
        return out

    async def torch_save(self) -> dict:
        path = self.b.path(f"torch-{self.label}.pt")
        s = await self.b.trainer.torch_save.remote(path)
        out = {"seconds": s, "bytes": disk.tree_bytes(path)}
        disk.remove(path)
        return out

    async def titan_sync(self) -> dict:
        path = self.b.path(f"titan-sync-{self.label}")
        disk.settle()
        r = await self.b.trainer.titan_save.remote(path, "sync")
        r["bytes"] = disk.tree_bytes(path)
        await self.b.trainer.phases.remote()
        disk.drop_cache([path], self.b.cache)
        r["load_s"] = await self.b.trainer.titan_load.remote(path)
        disk.remove(path)
        return r

    async def titan_async(self) -> dict:
        path = self.b.path(f"titan-async-{self.label}")
        disk.settle()
        r = await self.b.trainer.titan_save.remote(path, "async")
        r["bytes"] = disk.tree_bytes(path)
        disk.remove(path)
        return r

    async def forge_full_sync(self) -> dict:
        b, full, everyone = self.b, self.full, self.everyone
        r = await forge_save(b, full, everyone, "sync", keep=True)
        r["load"] = await forge_load(b, full, everyone, r["step"], verify=True)
        r["load_noverify"] = await forge_load(b, full, everyone, r["step"], verify=False)
        disk.remove(layout.step_dir(full.config.folder, r["step"]))
        return r


async def state_point(b: Bench, total: int) -> dict[str, Any]:
    """Everything at one total state size: raw disk, torch.save, TorchTitan alone (sync, async,
    load), forge_ckpt trainer only, forge_ckpt trainer + actors (sync, async, cold load)."""
    label = f"{total // MiB}MiB"
    trainer_bytes = int(total * TRAINER_SHARE)
    per_actor = (total - trainer_bytes) // SWEEP_ACTORS
    t0 = time.perf_counter()
    info = await b.trainer.setup.remote(trainer_bytes, b.device)
    actor_bytes = await size_actors(b, SWEEP_ACTORS, per_actor)
    actors = b.pool[:SWEEP_ACTORS]
    full = coordinator(b, f"forge-full-{label}", trainer=True, actors=actors)
    tonly = coordinator(b, f"forge-trainer-{label}", trainer=True, actors=[])
    log.info(
        "state %s: trainer %.0f MiB (%d params, %d tensors), %d actors x %.0f MiB, setup %.1fs",
        label, info["tensor_bytes"] / MiB, info["params"], info["tensors"], SWEEP_ACTORS,
        per_actor / MiB, time.perf_counter() - t0,
    )  # fmt: skip
    # Warm-up (not recorded): first-call costs (imports, process groups, the trainer's staging
    # buffers, which both coordinators share: it is the same TrainerCheckpointer).
    everyone = [b.trainer, *actors]
    nbytes = (await forge_save(b, full, everyone, "sync"))["bytes"]
    await forge_save(b, full, everyone, "async")
    methods = StateMethods(b, label, nbytes, full, tonly).methods()
    trials = await run_trials(b, f"state {label}", methods, lambda _, row: _summary(row, nbytes))
    full.close()
    tonly.close()
    disk.remove(full.config.folder)
    disk.remove(tonly.config.folder)
    return {
        "total_target": total,
        "trainer": info,
        "actor_bytes": actor_bytes,
        "actors": SWEEP_ACTORS,
        "full_bytes": nbytes,
        "trials": trials,
    }


def _summary(row: dict, nbytes: int) -> str:
    parts = []
    raw = row.get("raw")
    if raw:
        parts.append(f"raw write {nbytes / raw['write_s'] / 1e6:.0f} MB/s")
        parts.append(f"raw read {nbytes / raw['read_s'] / 1e6:.0f} MB/s")
    for k in ("titan_sync", "forge_trainer_sync", "forge_full_sync", "forge_full_async"):
        r = row.get(k)
        if r:
            parts.append(f"{k} {r['total_s']:.2f}s (blocked {r['blocked_s']:.2f}s)")
    load = (row.get("forge_full_sync") or {}).get("load")
    if load:
        parts.append(f"load {load['seconds']:.2f}s")
    return ", ".join(parts)
