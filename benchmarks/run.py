"""`python -m benchmarks.run` (= `make bench`): measure forge_ckpt against the disk, torch.save
and TorchTitan alone, then write docs/benchmarks.md, docs/benchmarks.json and docs/img/*.png.

    python -m benchmarks.run                 # the full suite (~10 min on a 2-core VM, plus
        ~5-8 min for the storage part at 1 GiB)
    python -m benchmarks.run --quick         # a ~2 min smoke run, report under runs/bench-quick/
    python -m benchmarks.run --trials 3      # fewer trials per figure (default 5)
    python -m benchmarks.run --report-only docs/benchmarks.json   # re-render the report
    python -m benchmarks.run --parts gpu --out runs/gpu   # on a CUDA machine: the GPU check
    python -m benchmarks.run --merge-gpu docs/benchmarks_gpu.json   # CPU run + that GPU part
    python -m benchmarks.run --parts storage --trials 3 --storage-mib 1024   # S3 + local DCP
        I/O only (~5 min): merged into the existing docs/benchmarks.{json,md}, rest untouched

Scratch files go to runs/bench/ (on the disk under test) and are deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import platform
import shlex
import shutil
import sys
import time
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import ray  # noqa: E402
import torch  # noqa: E402

from . import contention, disk, experiments, report, setup_logging, state_sweep  # noqa: E402
from .storage import bench as storage_bench  # noqa: E402
from .timers import install_timers  # noqa: E402

log = logging.getLogger("benchmarks")
MiB = disk.MiB

FULL_SIZES_MIB = [64, 256, 1024, 2048]
QUICK_SIZES_MIB = [64, 256]
FULL_ACTORS = [1, 4, 16, 64]
QUICK_ACTORS = [1, 4, 8]
PARTS = ["state", "actors", "gpu", "storage"]
RAM_FACTOR = 3.5  # peak memory of a state point, in units of its total state (measured ~2.5x)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Benchmark forge_ckpt against the raw disk, torch.save and TorchTitan alone; "
        "writes docs/benchmarks.md, docs/benchmarks.json and docs/img/*.png.",
    )
    p.add_argument("--quick", action="store_true", help="small sizes, 2 trials (~2 minutes)")
    p.add_argument(
        "--trials", type=int, default=None, help="trials per figure (default 5; 2 with --quick)"
    )
    p.add_argument("--sizes", type=int, nargs="+", help="total state sizes in MiB")
    p.add_argument("--actors", type=int, nargs="+", help="actor counts of the scaling sweep")
    p.add_argument("--actor-total", type=int, help="MiB held by all actors together (256)")
    p.add_argument("--gpu-gib", type=float, default=6.0, help="trainer state of the GPU check")
    p.add_argument("--work-dir", default="runs/bench", help="scratch folder on the disk to test")
    p.add_argument("--out", help="report folder (default docs/, or runs/bench-quick/ if --quick)")
    p.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=PARTS,
        help="which parts to run (default all; 'gpu' runs only where CUDA is present; "
        "'storage' alone is merged into the existing report instead of replacing it)",
    )
    p.add_argument(
        "--storage-mib",
        type=int,
        default=None,
        help="state saved by the storage part (S3 and local DCP I/O; default 1024, 128 --quick)",
    )
    p.add_argument("--report-only", metavar="JSON", help="render the report from a results file")
    p.add_argument(
        "--merge-gpu",
        metavar="JSON",
        help="where this machine has no GPU: report the GPU part of another run's results "
        "(made with --parts gpu on a CUDA machine), described with that machine",
    )
    args = p.parse_args(argv)
    if args.trials is None:
        args.trials = 2 if args.quick else 5
    if args.sizes is None:
        args.sizes = QUICK_SIZES_MIB if args.quick else FULL_SIZES_MIB
    if args.actors is None:
        args.actors = QUICK_ACTORS if args.quick else FULL_ACTORS
    if args.storage_mib is None:
        args.storage_mib = 128 if args.quick else 1024
    if args.actor_total is None:
        args.actor_total = 64 if args.quick else 256
    if args.out is None:
        args.out = "runs/bench-quick" if args.quick else "docs"
    if args.trials < 1:
        p.error("--trials must be >= 1")
    return args


def machine_info(work_dir: str) -> dict[str, Any]:
    def meminfo(key: str) -> int:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    import numpy
    import torchtitan

    from forge_ckpt import __version__

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_bytes": meminfo("MemTotal"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchtitan": getattr(torchtitan, "__version__", "?"),
        "ray": ray.__version__,
        "numpy": numpy.__version__,
        "forge_ckpt": __version__,
        "kernel": platform.release(),
        "filesystem": _filesystem(work_dir),
        "disk_free_bytes": shutil.disk_usage(work_dir).free,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _filesystem(path: str) -> str:
    """'<device> <fstype> <options>' of the mount holding `path`."""
    path = os.path.realpath(path)
    best = ("", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, opts = line.split()[:4]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(
                    best[0]
                ):
                    best = (mnt, f"{dev} {fstype} ({opts}) mounted at {mnt}")
    except OSError:
        pass
    return best[1]


async def run(args: argparse.Namespace, results: dict[str, Any]) -> None:
    from forge_ckpt import spawn_trainer_ranks

    from .actors import BenchActor
    from .trainer_rank import BenchTrainer

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    trainer_cls = ray.remote(num_gpus=1)(BenchTrainer) if cuda else ray.remote(BenchTrainer)
    b = experiments.Bench(
        root=os.path.abspath(args.work_dir),
        trials=args.trials,
        cache=results["cache_method"],
        device=device,
        trainer_cls=trainer_cls,
        actor_cls=ray.remote(BenchActor),
    )
    install_timers("driver")
    t = time.perf_counter()
    b.trainer = spawn_trainer_ranks(trainer_cls, 1)[0]
    await experiments.grow_pool(b, experiments.SWEEP_ACTORS)
    results["startup_s"] = {"trainer_and_4_actors": time.perf_counter() - t}

    results["state"] = []
    for mib in args.sizes if "state" in args.parts else []:
        total = mib * MiB
        need = int(RAM_FACTOR * total)
        avail = disk.mem_available()
        if avail and need > avail:
            msg = f"state {mib} MiB skipped: needs ~{need / 2**30:.1f} GiB RAM, {avail / 2**30:.1f} free"
            log.warning(msg)
            b.errors.append(msg)
            continue
        t = time.perf_counter()
        results["state"].append(await state_sweep.state_point(b, total))
        results["state"][-1]["wall_s"] = time.perf_counter() - t
        _checkpoint(args, results, b)

    if cuda and "gpu" in args.parts:
        t = time.perf_counter()
        gpu = await experiments.gpu_point(b, int(args.gpu_gib * 2**30))
        gpu["wall_s"] = time.perf_counter() - t
        results["gpu"] = gpu
    ray.kill(b.trainer)  # frees its memory for the actor processes

    results["actors"] = []
    for n in sorted(args.actors) if "actors" in args.parts else []:
        t = time.perf_counter()
        start = await experiments.grow_pool(b, n)
        point = await experiments.actor_point(b, n, args.actor_total * MiB)
        point["pool_start_s"] = start
        point["wall_s"] = time.perf_counter() - t
        results["actors"].append(point)
        _checkpoint(args, results, b)
    results["errors"] = b.errors


def _checkpoint(args: argparse.Namespace, results: dict, b: experiments.Bench) -> None:
    """Keep partial results on disk (the scratch folder's sibling) in case the run dies."""
    results["errors"] = b.errors
    os.makedirs(os.path.dirname(os.path.abspath(args.work_dir)), exist_ok=True)
    with open(os.path.abspath(args.work_dir) + ".partial.json", "w") as f:
        json.dump(results, f, default=str)


def _merge_gpu(results: dict[str, Any], path: str | None) -> None:
    """Without a GPU here, report the GPU part of another run (made with `--parts gpu` on a
    CUDA machine), described with that machine."""
    if results.get("gpu") or not path:
        return
    if not os.path.exists(path):
        log.warning("no GPU results at %s: the GPU target is reported as not measured", path)
        return
    with open(path) as f:
        other = json.load(f)
    if other.get("gpu"):
        results["gpu"] = other["gpu"]
        results["gpu_run"] = {k: other[k] for k in ("command", "date", "machine", "wall_s")}


def _command(argv: list[str] | None) -> str:
    return "python -m benchmarks.run" + "".join(
        " " + shlex.quote(a) for a in (argv or sys.argv[1:])
    )


def _storage(args: argparse.Namespace, command: str, cache: str) -> dict[str, Any] | str:
    """The storage part's results, or why it failed (the other parts' results still count)."""
    try:
        out = storage_bench.run_storage(args.storage_mib, args.trials, args.work_dir, cache)
    except Exception as e:  # a server that did not start, a missing package: report, go on
        log.exception("storage part failed")
        return f"storage part failed: {type(e).__name__}: {e}"
    out["command"] = command
    return out


def _storage_only(args: argparse.Namespace, command: str) -> int:
    """`--parts storage`: measure that part alone and merge it into the existing report."""
    os.makedirs(args.work_dir, exist_ok=True)
    try:
        storage = _storage(args, command, disk.drop_cache_method())
    finally:
        shutil.rmtree(args.work_dir, ignore_errors=True)
    if isinstance(storage, str):
        return 1
    report.merge_storage(storage, args.out)
    log.info("storage part done in %.0fs; merged into %s", storage["wall_s"], args.out)
    return 0


def _new_results(args: argparse.Namespace, command: str) -> dict[str, Any]:
    return {
        "command": command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(args.work_dir),
        "cache_method": disk.drop_cache_method(),
        "config": {
            "trials": args.trials,
            "sizes_mib": args.sizes,
            "actor_counts": args.actors,
            "actor_total_mib": args.actor_total,
            "trainer_share": experiments.TRAINER_SHARE,
            "sweep_actors": experiments.SWEEP_ACTORS,
            "quick": args.quick,
            "gpu_gib": args.gpu_gib,
            "parts": args.parts,
            "storage_mib": args.storage_mib,
        },
    }


def _run_all(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The Ray parts, then (Ray stopped: its memory back) the storage part."""
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}},
    )
    try:
        asyncio.run(run(args, results))
    finally:
        ray.shutdown()
    if "storage" in args.parts:
        waited = contention.settle()
        log.info("storage part: waited %.0fs for the Ray parts' load to settle", waited)
        storage = _storage(args, results["command"], results["cache_method"])
        if isinstance(storage, str):
            results["errors"].append(storage)
        else:
            results["storage"] = storage


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    if args.report_only:
        with open(args.report_only) as f:
            results = json.load(f)
        _merge_gpu(results, args.merge_gpu)
        report.write(results, args.out)
        return 0
    if args.parts == ["storage"]:
        return _storage_only(args, _command(argv))

    os.makedirs(args.work_dir, exist_ok=True)
    results = _new_results(args, _command(argv))
    start, load = time.perf_counter(), contention.now()
    try:
        _run_all(args, results)
    finally:
        shutil.rmtree(args.work_dir, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - start
    results["load"] = contention.record(load)
    _merge_gpu(results, args.merge_gpu)
    report.write(results, args.out)
    partial = os.path.abspath(args.work_dir) + ".partial.json"
    if os.path.exists(partial):
        os.unlink(partial)
    log.info("done in %.0fs; report in %s", results["wall_s"], args.out)
    return 1 if results.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
