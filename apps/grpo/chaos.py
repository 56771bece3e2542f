"""Kill harness: SIGKILL the GRPO job at random moments, restart it each time, and check that the
finished run is bit-for-bit the uninterrupted one.

    python -m apps.grpo.chaos --kills 200 --seed 0 [--config configs/grpo_test.yaml]
                              [--out docs/chaos_last_run.json] [key=value ...]

It first runs the job once without interruption (the reference). Then it starts the same job in
a new run_dir and, over and over, lets it make progress, waits a random moment (drawn from
`--seed`) and kills it: the driver's whole process group with SIGKILL, or, with
`--shared-ray`, only the driver on a Ray cluster the harness keeps up (its actors die with it;
much faster restarts). A third of the kills wait for a save to be in flight (a `step-N/`
folder without its marker) and kill then; disk syncs are slowed (`FORGE_CKPT_FAULT=fsync:
sleep=...`) so that saves take long enough to be hit. After each kill it records what was
committed, and on the next start it reads which step the job resumed from. The report counts
trials, kills during a save, steps redone, partial steps ever loaded, and whether the final
metrics and weights equal the reference.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from forge_ckpt import committed_steps, pending_steps

METRICS, WEIGHTS, CHECKPOINTS = "metrics.jsonl", "final_weights.safetensors", "checkpoints"
RESUMED = re.compile(r"GRPO: (resumed at step (\d+)|fresh start)")


class Job:
    """One start of the GRPO job as a child process in its own process group."""

    def __init__(self, config: str, run_dir: str, overrides: list[str], env: dict, log: str):
        cmd = [sys.executable, "-m", "apps.grpo.main", "--config", config, f"run_dir={run_dir}"]
        self.log, self.holds = log, env.get(CHAOS_HOLD) == "between_saves"
        self.proc = subprocess.Popen(
            cmd + overrides,
            stdout=open(log, "w"),  # noqa: SIM115 (the child owns it)
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def holding(self) -> int | None:
        """The step after which this start holds (`GRPO_CHAOS_HOLD`), once it has said so."""
        with open(self.log) as f:
            m = HOLDING.search(f.read())
        return int(m.group(1)) if m else None

    def resumed_from(self) -> int | None:
        """The step this start loaded (0 for a fresh start), once it has said so."""
        with open(self.log) as f:
            m = RESUMED.search(f.read())
        if m is None:
            return None
        return int(m.group(2)) if m.group(2) else 0


CHAOS_KILL = "GRPO_CHAOS_KILL"
CHAOS_HOLD = "GRPO_CHAOS_HOLD"
HOLDING = re.compile(r"chaos: holding after step (\d+)")
_killed: set[str] = set()
_held: list[int] = []  # the step this process held after (GRPO_CHAOS_HOLD), at most one


def chaos_hook(job: Any, step: int) -> None:
    """Tests of the job's supervision: `GRPO_CHAOS_KILL=replay@5` (or dataset, policy, reward,
    trainer) makes the driver `ray.kill` that actor right after step 5 trained, once per
    process: the next call to it fails as if it had crashed, and the job must recover."""
    spec = os.environ.get(CHAOS_KILL)
    if not spec or spec in _killed:
        return
    name, _, at = spec.partition("@")
    if int(at) != step:
        return
    import ray

    _killed.add(spec)
    first = {"trainer": job.ranks[0], "dataset": job.datasets[0]}  # rank 0, replica 0
    handle = first[name] if name in first else getattr(job, name)
    print(f"chaos: killing {name} after step {step}", flush=True)
    ray.kill(handle, no_restart=True)


async def chaos_hold(step: int, stop: Any) -> None:
    """Tests of a kill between two saves: `GRPO_CHAOS_HOLD=between_saves` makes the driver
    stop after the first step of this process that is not saved (its line written) until
    SIGTERM, so that a test kills it there for certain instead of racing a short window."""
    if os.environ.get(CHAOS_HOLD) != "between_saves" or _held:
        return
    _held.append(step)
    print(f"chaos: holding after step {step}", flush=True)
    await stop.wait()


def metrics_lines(run_dir: str) -> int:
    """The step lines of metrics.jsonl (event lines are not steps)."""
    try:
        with open(os.path.join(run_dir, METRICS), "rb") as f:
            lines = f.read().split(b"\n")[:-1]
    except FileNotFoundError:
        return 0
    return sum(1 for line in lines if not line.startswith(b'{"event"'))


def saving(folder: str) -> bool:
    """A save is in flight: a step folder exists that has no marker yet."""
    return bool(pending_steps(folder))


def wait_until(job: Job, predicate, timeout: float, poll: float = 0.002) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not job.alive():
            return False
        if predicate():
            return True
        time.sleep(poll)
    return False


@dataclass
class Kill:
    trial: int
    moment: str  # "random" | "during_save" | "after_commit"
    lines_at_kill: int
    committed_at_kill: list[int]
    during_save: bool
    resumed_from: int | None = None  # filled by the next start
    redone: int | None = None  # steps computed again after this kill


@dataclass
class Report:
    kills: list[Kill] = field(default_factory=list)
    trials: int = 0
    reference_s: float = 0.0
    chaos_s: float = 0.0
    metrics_equal: bool = False
    weights_equal: bool = False
    partial_loaded: int = 0
    max_redone: int = 0
    interval: int = 0

    def summary(self) -> dict:
        return {
            "trials": self.trials,
            "kills": len(self.kills),
            "kills_during_save": sum(k.during_save for k in self.kills),
            "kills_right_after_commit": sum(k.moment == "after_commit" for k in self.kills),
            "steps_redone_total": sum(k.redone or 0 for k in self.kills),
            "max_steps_redone_after_one_kill": self.max_redone,
            "checkpoint_interval": self.interval,
            "partial_steps_loaded": self.partial_loaded,
            "final_metrics_equal": self.metrics_equal,
            "final_weights_equal": self.weights_equal,
            "reference_run_s": round(self.reference_s, 1),
            "chaos_run_s": round(self.chaos_s, 1),
        }


MOMENTS = ("random", "random", "during_save", "after_commit", "between_saves")


def kill_once(job: Job, run_dir: str, rng: random.Random, trial: int) -> Kill | None:
    """Let the job make progress, then kill it at a moment drawn from `rng`; None if it ended."""
    start_lines = metrics_lines(run_dir)
    if not wait_until(job, lambda: metrics_lines(run_dir) > start_lines, timeout=600):
        return None
    return kill_at(job, run_dir, rng.choice(MOMENTS), rng, trial)


def kill_at(
    job: Job,
    run_dir: str,
    moment: str,
    rng: random.Random | None = None,
    trial: int = 0,
    folder: str | None = None,
) -> Kill | None:
    """SIGKILL the job at `moment`: "during_save" (a step folder without marker exists),
    "after_commit" (a new marker just appeared), "between_saves" (a step finished that is not
    being saved), or "random" (0-3 s from now). None if the job ended first. `folder` is
    the checkpoint folder when the run sets `checkpoint.folder` (e.g. s3://...)."""
    folder = folder or os.path.join(run_dir, CHECKPOINTS)
    if moment == "during_save":
        hit = wait_until(job, lambda: saving(folder), timeout=300, poll=0.001)
    elif moment == "after_commit":
        newest = max(committed_steps(folder), default=0)
        hit = wait_until(job, lambda: max(committed_steps(folder), default=0) > newest, 300, 0.001)
    elif moment == "between_saves" and job.holds:  # held there: once every save has ended
        hit = wait_until(job, lambda: job.holding() is not None and not saving(folder), 600)
    elif moment == "between_saves":  # (a short window: the soak's kills may miss it)
        lines = metrics_lines(run_dir)
        hit = wait_until(
            job,
            lambda: (
                metrics_lines(run_dir) > lines
                and not saving(folder)
                and metrics_lines(run_dir) not in committed_steps(folder)
            ),
            timeout=300,
            poll=0.001,
        )
    else:
        time.sleep((rng or random.Random()).uniform(0.0, 3.0))
        hit = job.alive()
    if not hit:
        return None
    during = saving(folder)
    job.kill()
    return Kill(trial, moment, metrics_lines(run_dir), committed_steps(folder), during)


def run_chaos(args: argparse.Namespace, overrides: list[str], env: dict) -> Report:
    rng = random.Random(args.seed)
    report = Report(interval=args.interval)
    ref_dir, run_dir = os.path.join(args.workdir, "reference"), os.path.join(args.workdir, "chaos")
    t0 = time.perf_counter()
    ref = Job(args.config, ref_dir, overrides, {}, os.path.join(args.workdir, "reference.log"))
    if ref.wait(timeout=3600) != 0:
        raise SystemExit(f"reference run failed: see {ref.log}")
    report.reference_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    previous: Kill | None = None
    while True:
        report.trials += 1
        log = os.path.join(args.workdir, f"chaos-{report.trials:04d}.log")
        job = Job(args.config, run_dir, overrides, env, log)
        if not wait_until(job, lambda j=job: j.resumed_from() is not None, 600, poll=0.05):
            if job.alive():
                job.kill()
            raise SystemExit(f"job did not start: see {log}")
        resumed = job.resumed_from()
        if previous is not None:
            account(report, previous, resumed)
        kill = (
            kill_once(job, run_dir, rng, report.trials) if len(report.kills) < args.kills else None
        )
        if kill is None:  # the job is left to finish
            if job.wait(timeout=3600) != 0:
                raise SystemExit(f"job failed: see {log}")
            break
        report.kills.append(kill)
        previous = kill
        print(
            f"kill {len(report.kills)}/{args.kills}: {kill.moment}, {kill.lines_at_kill} steps, "
            f"committed {kill.committed_at_kill[-1:]}, during save: {kill.during_save}",
            flush=True,
        )
    report.chaos_s = time.perf_counter() - t0
    for name, attr in ((METRICS, "metrics_equal"), (WEIGHTS, "weights_equal")):
        a, b = os.path.join(ref_dir, name), os.path.join(run_dir, name)
        setattr(report, attr, filecmp.cmp(a, b, shallow=False))
    return report


def account(report: Report, kill: Kill, resumed: int) -> None:
    """Check the start after `kill` loaded the newest step committed at the kill."""
    kill.resumed_from = resumed
    newest = kill.committed_at_kill[-1] if kill.committed_at_kill else 0
    if resumed != newest:
        report.partial_loaded += 1
    kill.redone = max(kill.lines_at_kill - resumed, 0)
    report.max_redone = max(report.max_redone, kill.redone)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default="configs/grpo_test.yaml")
    p.add_argument("--workdir", default="runs/chaos")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--slow-fsync", type=float, default=0.05, help="seconds added to each fsync")
    p.add_argument("--shared-ray", action="store_true", help="keep one Ray cluster up")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    overrides = list(args.overrides)
    args.interval = _interval(args.config, overrides)
    env = {"FORGE_CKPT_FAULT": f"fsync:sleep={args.slow_fsync}"} if args.slow_fsync else {}
    if args.shared_ray:
        overrides.append(f"ray.address={_start_shared_ray(env)}")
    report = run_chaos(args, overrides, env)
    result = {
        "command": " ".join(["python -m apps.grpo.chaos", *(argv or sys.argv[1:])]),
        "summary": report.summary(),
        "kills": [asdict(k) for k in report.kills],
    }
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    ok = report.metrics_equal and report.weights_equal and report.partial_loaded == 0
    return 0 if ok and report.max_redone <= args.interval else 1


def _interval(config: str, overrides: list[str]) -> int:
    from .config import load_config

    return int(load_config(config, overrides)["checkpoint"]["interval"])


def _start_shared_ray(env: dict) -> str:
    """A Ray cluster owned by the harness: only the job's driver (and its actors) get killed."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.update(env)  # inherited by the raylet, so by every actor of every job
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    return ray.get_runtime_context().gcs_address


if __name__ == "__main__":
    sys.exit(main())
