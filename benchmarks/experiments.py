"""The measurements. Each trial runs every method once, back to back, on the same disk, so a
ratio is taken between neighbours in time (the disk's speed drifts over minutes); the order of
the methods is shuffled from trial to trial so that no method always follows the same one."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from forge_ckpt import CheckpointConfig, CheckpointCoordinator
from forge_ckpt.steps import layout

from . import disk
from .timers import take_phases

log = logging.getLogger("benchmarks")

MiB = disk.MiB
TRAINER_SHARE = 0.5  # of the total state in the state sweep; the rest is split over the actors
SWEEP_ACTORS = 4


@dataclass
class Bench:
    root: str  # scratch folder on the disk under test (deleted at the end)
    trials: int
    cache: str  # how reads are made cold: 'drop_caches' or 'fadvise'
    device: str  # where the trainer's tensors live: 'cpu' or 'cuda'
    trainer_cls: Any
    actor_cls: Any
    trainer: Any = None
    pool: list = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    steps: int = 0

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def next_step(self) -> int:
        self.steps += 1
        return self.steps


# ---- helpers ----------------------------------------------------------------------------------


async def _gather(calls: list) -> list:
    return list(await asyncio.gather(*calls))


async def _phases(handles: list) -> list[dict]:
    return await _gather([h.phases.remote() for h in handles])


async def grow_pool(b: Bench, n: int) -> float:
    """Start actors until the pool holds `n`; returns the seconds it took."""
    start = time.perf_counter()
    new = [b.actor_cls.remote() for _ in range(n - len(b.pool))]
    if new:
        await _gather([a.ping.remote() for a in new])
        b.pool.extend(new)
    return time.perf_counter() - start


async def size_actors(b: Bench, n: int, per_actor: int) -> int:
    """The first `n` pool actors hold `per_actor` bytes each; the others hold nothing."""
    sizes = await _gather(
        [a.resize.remote(per_actor if i < n else 0, i) for i, a in enumerate(b.pool)]
    )
    return sum(sizes[:n])


def coordinator(b: Bench, name: str, trainer: bool, actors: list) -> CheckpointCoordinator:
    folder = b.path(name)
    disk.remove(folder)
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder, keep_last=None))
    if trainer:
        coord.set_trainer([b.trainer])
    if actors:
        coord.register("buffer", actors)
    return coord


async def _loop_lag(stop: asyncio.Event) -> float:
    """The longest the driver's event loop was unresponsive (1 ms ticks) until `stop`."""
    worst = 0.0
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        worst = max(worst, time.perf_counter() - t - 0.001)
    return worst


async def forge_save(
    b: Bench, coord: CheckpointCoordinator, handles: list, mode: str, keep: bool = False
) -> dict[str, Any]:
    """One `coord.save()`: sync, or in the background ("async": now the deferred mode, which
    replaced it) followed by `wait()`. Times seen by the caller, the coordinator's own
    SaveResult, and each process's phase timers."""
    coord.config.async_mode = "sync" if mode == "sync" else "deferred"
    step = b.next_step()
    await _phases(handles)
    take_phases()
    disk.settle()
    stop = asyncio.Event()
    start = time.perf_counter()
    res = await coord.save(step)
    blocked = time.perf_counter() - start
    lag = None
    if mode != "sync":
        lag_task = asyncio.create_task(_loop_lag(stop))
        res = await coord.wait()
        stop.set()
        lag = await lag_task
    total = time.perf_counter() - start
    driver = take_phases()
    units = await _phases(handles)
    path = layout.step_dir(coord.config.folder, step)
    out = {
        "blocked_s": blocked,
        "total_s": total,
        "bytes": disk.tree_bytes(path),
        "snapshot_bytes": res.nbytes,
        "coord_blocked_s": res.blocked_s,
        "coord_total_s": res.total_s,
        "component_s": dict(res.seconds),
        "loop_lag_s": lag,
        "driver": driver,
        "units": units,
        "poll_slack_s": _poll_slack(driver, units),
        "step": step,
    }
    _slim([driver, *units])
    if not keep:
        disk.remove(path)
    return out


def _slim(phases: list[dict]) -> None:
    """Keep only the phase seconds (and memory) in the results; end times are used above."""
    for p in phases:
        p.pop("end", None)
        p.pop("calls", None)


def _poll_slack(driver: dict, units: list[dict]) -> float | None:
    """Seconds between the last component finishing its write and the commit starting: the
    coordinator's polling delay (plus the Ray round trip of the status call)."""
    ends = [
        u["end"].get("write_total", u["end"].get("file_write"))
        for u in units
        if "write_total" in u["end"] or "file_write" in u["end"]
    ]
    if not ends or "commit" not in driver["end"]:
        return None
    commit_start = driver["end"]["commit"] - driver["seconds"]["commit"]
    return commit_start - max(ends)


async def forge_load(
    b: Bench, coord: CheckpointCoordinator, handles: list, step: int, verify: bool
) -> dict[str, Any]:
    """`coord.load(step)` with every file of the step evicted from the page cache first."""
    path = layout.step_dir(coord.config.folder, step)
    coord.config.verify_on_load = verify
    await _phases(handles)
    take_phases()
    disk.drop_cache([path], b.cache)
    start = time.perf_counter()
    await coord.load(step=step)
    seconds = time.perf_counter() - start
    coord.config.verify_on_load = True
    out = {
        "seconds": seconds,
        "bytes": disk.tree_bytes(path),
        "verify": verify,
        "driver": take_phases(),
        "units": await _phases(handles),
    }
    _slim([out["driver"], *out["units"]])
    return out


async def _attempt(b: Bench, what: str, fn: Callable[[], Awaitable[Any]]) -> Any:
    """Run one measurement; a failure is recorded (and reported) instead of ending the run."""
    try:
        return await fn()
    except Exception as e:  # noqa: BLE001 - reported in the results
        msg = f"{what}: {type(e).__name__}: {e}"
        log.error("%s\n%s", msg, traceback.format_exc())
        b.errors.append(msg)
        return None


async def run_trials(
    b: Bench, what: str, methods: list, describe: Callable[[int, dict], str]
) -> list[dict]:
    """Every method once per trial, in a shuffled order; one log line per trial."""
    trials = []
    for trial in range(b.trials):
        row: dict[str, Any] = {}
        for name, fn in _order(methods, trial):
            row[name] = await _attempt(b, f"{what} trial {trial} {name}", fn)
        row["loadavg"] = os.getloadavg()[0]
        trials.append(row)
        log.info("%s trial %d: %s", what, trial, describe(trial, row))
    return trials


def _order(items: list, trial: int) -> list:
    """The methods in a different order every trial (seeded, so runs are repeatable): no
    method always follows the same one, whose deletions and writeback it could pay for."""
    out = list(items)
    random.Random(trial).shuffle(out)
    return out


# ---- actor scaling: same total bytes over 1..64 actors --------------------------------------------


async def actor_point(b: Bench, n: int, total: int) -> dict[str, Any]:
    await grow_pool(b, n)
    actor_bytes = await size_actors(b, n, total // n)
    actors = b.pool[:n]
    coord = coordinator(b, f"actors-{n}", trainer=False, actors=actors)
    warm = await forge_save(b, coord, actors, "sync")
    await forge_save(b, coord, actors, "async")
    nbytes = warm["bytes"]
    raw_file = b.path(f"raw-actors-{n}.bin")
    point: dict[str, Any] = {"actors": n, "actor_bytes": actor_bytes, "bytes": nbytes}
    point["trials"] = []

    async def raw() -> dict:
        w = disk.python_write(raw_file, nbytes)
        r = disk.cold_read(raw_file, b.cache)
        disk.remove(raw_file)
        files = b.path(f"raw-actors-{n}")
        wf = disk.python_write_files(files, n, nbytes)
        disk.remove(files)
        start = time.perf_counter()
        await _gather([a.ping.remote() for a in actors])
        ping = time.perf_counter() - start
        return {"write_s": w, "read_s": r, "files_write_s": wf, "ping_s": ping, "bytes": nbytes}

    async def sync() -> dict:
        r = await forge_save(b, coord, actors, "sync", keep=True)
        r["load"] = await forge_load(b, coord, actors, r["step"], verify=True)
        disk.remove(layout.step_dir(coord.config.folder, r["step"]))
        return r

    async def background() -> dict:
        return await forge_save(b, coord, actors, "async")

    def describe(trial: int, row: dict) -> str:
        s, a = row.get("forge_sync"), row.get("forge_async")
        return (f"sync {s['total_s']:.2f}s" if s else "sync failed") + (
            f", async blocked {a['blocked_s']:.3f}s" if a else ", async failed"
        )

    methods = [("raw", raw), ("forge_sync", sync), ("forge_async", background)]
    point["trials"] = await run_trials(b, f"{n} actors", methods, describe)
    coord.close()
    disk.remove(coord.config.folder)
    return point


# ---- GPU: blocking time of an async save of a large trainer state -------------------------------


async def gpu_point(b: Bench, total: int) -> dict[str, Any]:
    """Trainer only, on CUDA: how long `save()` blocks in async mode (the device-to-host copy
    into reused pinned buffers), against the bare device-to-host copy of the same tensors into
    pinned memory (the floor) and TorchTitan's own async `dcp_save`; the sync save for
    reference."""
    info = await b.trainer.setup.remote(total, "cuda")
    coord = coordinator(b, "gpu", trainer=True, actors=[])
    await forge_save(b, coord, [b.trainer], "async")  # warm-up: allocates the pinned buffers
    await b.trainer.d2h_copy.remote()  # warm-up: allocates its own pinned buffers
    point: dict[str, Any] = {"total_target": total, "trainer": info, "trials": []}

    async def titan_async() -> dict:
        path = b.path("titan-async-gpu")
        disk.settle()
        r = await b.trainer.titan_save.remote(path, "async")
        disk.remove(path)
        return r

    methods = [
        ("d2h_copy", lambda: b.trainer.d2h_copy.remote()),
        ("titan_async", titan_async),
        ("forge_async", lambda: forge_save(b, coord, [b.trainer], "async")),
        ("forge_sync", lambda: forge_save(b, coord, [b.trainer], "sync")),
    ]

    def describe(trial: int, row: dict) -> str:
        fa, d2h, ta = row["forge_async"], row["d2h_copy"], row["titan_async"]
        return ", ".join(
            [
                f"forge async blocked {fa['blocked_s']:.3f}s" if fa else "forge async failed",
                f"d2h copy {d2h:.3f}s" if d2h is not None else "d2h copy failed",
                f"titan async blocked {ta['blocked_s']:.3f}s" if ta else "titan async failed",
            ]
        )

    point["trials"] = await run_trials(b, "gpu", methods, describe)
    coord.close()
    disk.remove(coord.config.folder)
    return point
