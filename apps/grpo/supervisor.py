"""Supervision: when an actor of the job dies (its node was lost, it crashed, it was killed), the
job brings itself back instead of exiting.

A death shows up as a Ray error from any call of a step (`RayActorError`, a lost object) or as
a `CheckpointSaveError` whose `lost` lists the units that are gone. Recovery then:

1. names what died (every actor of the job is probed) and logs it;
2. tears the step down: kills every remaining actor of the job (their state is thrown away:
   it is reloaded from the checkpoint), flushes the coordinator's failed background save. The
   coordinator and its lease on the folder stay: no other job can take the folder meanwhile;
3. starts the job's actors again (on the nodes that remain), waiting at most `recovery.wait_s`
   for Ray to place them, and registers them with the coordinator (`replace=True`);
4. the caller loads the newest committed step and goes on, as a restarted job would: the steps
   after it are computed again, exactly.

At most `recovery.max_restarts` recoveries per process; each one is a line of `metrics.jsonl`
(`{"event": "recovery", ...}`: what died, the step it failed at, the step it resumed from, how
long it took; the step lines stay those of an uninterrupted run) and is counted in the final
summary.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from forge_ckpt import CheckpointCoordinator, describe_failure, is_lost

from .metrics import MetricsLog

PROBE_S = 5.0  # how long a living actor may take to answer the probe


class RecoveryError(RuntimeError):
    """The job could not be brought back (restart budget spent, or no room on the cluster)."""


@dataclass(frozen=True)
class RecoveryConfig:
    max_restarts: int = 3
    wait_s: float = 120.0

    @classmethod
    def from_cfg(cls, cfg: dict[str, Any]) -> RecoveryConfig:
        rec = cfg.get("recovery") or {}
        return cls(int(rec.get("max_restarts", 3)), float(rec.get("wait_s", 120.0)))


def recoverable(e: BaseException) -> bool:
    """An actor, worker or node of the job is gone (not a bug in the job's code)."""
    return is_lost(e) or bool(getattr(e, "lost", None))


def job_actors(job: Any) -> dict[str, Any]:
    """Every actor of the job by a readable name."""
    if hasattr(job, "named_actors"):  # the async mode's job names its own
        return dict(job.named_actors())
    named = {f"actor {n!r}": getattr(job, n) for n in ("policy", "reward", "replay")}
    datasets = job.datasets
    if len(datasets) == 1:
        named["actor 'dataset'"] = datasets[0]
    else:
        named.update({f"actor 'dataset' replica {k}": h for k, h in enumerate(datasets)})
    named.update({f"trainer rank {r}": h for r, h in enumerate(job.ranks)})
    return named


async def probe(job: Any) -> dict[str, str]:
    """The actors of `job` that are dead (or do not answer), each with its one-line reason."""

    async def ask(handle: Any) -> str | None:
        try:
            await asyncio.wait_for(handle.__ray_ready__.remote(), PROBE_S)
            return None
        except TimeoutError:
            return f"no answer within {PROBE_S:.0f}s"
        except Exception as e:  # a Ray error: the actor is gone
            return describe_failure(e)

    named = job_actors(job)
    reasons = await asyncio.gather(*(ask(h) for h in named.values()))
    return {n: r for n, r in zip(named, reasons, strict=True) if r is not None}


def teardown(job: Any) -> None:
    """Kill every actor of the job; those already dead are skipped."""
    for handle in job_actors(job).values():
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # already gone
            pass


async def start_bounded(make_job: Callable[[], Any], wait_s: float) -> Any:
    """`make_job()` in a daemon thread, given at most `wait_s` (Ray waits forever for room)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def build() -> None:
        try:
            future.set_result(make_job())
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=build, daemon=True, name="grpo-start-job").start()
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), wait_s)
    except TimeoutError:
        raise RecoveryError(
            f"the job's actors were not all started within recovery.wait_s={wait_s:.0f}s: Ray "
            "found no room for them on the live nodes (see `ray status`); add nodes or raise "
            "recovery.wait_s, then run the same command again to resume"
        ) from None


class Supervisor:
    """Starts the job's actors and brings them back after a loss (see the module doc)."""

    def __init__(
        self,
        cfg: dict[str, Any],
        coord: CheckpointCoordinator,
        make_job: Callable[[], Any],
        log: MetricsLog,
    ) -> None:
        self.coord, self.make_job = coord, make_job
        self.config = RecoveryConfig.from_cfg(cfg)
        self.log = log
        self.restarts = 0
        self._pending: dict[str, Any] | None = None  # the recovery whose resume is not logged

    async def start(self) -> Any:
        """The job's actors, registered with the coordinator (replacing dead ones)."""
        job = await start_bounded(self.make_job, self.config.wait_s)
        job.register(self.coord, replace=True)
        return job

    async def recover(self, job: Any, error: BaseException, step: int) -> Any:
        """Replace a job that lost actors at `step`; re-raises `error` when it is not a loss,
        `RecoveryError` once `recovery.max_restarts` is spent."""
        if not recoverable(error):
            raise error
        t0 = time.perf_counter()
        dead = await probe(job) or {"(unknown)": describe_failure(error)}
        lines = "\n  ".join(f"{n}: {r}" for n, r in dead.items())
        print(f"GRPO: actor(s) lost during step {step}:\n  {lines}", flush=True)
        teardown(job)
        try:
            await self.coord.wait()  # a failed background save: its error is the one above
        except Exception:
            pass
        self.restarts += 1
        if self.restarts > self.config.max_restarts:
            raise RecoveryError(
                f"gave up after {self.config.max_restarts} recoveries "
                f"(recovery.max_restarts={self.config.max_restarts}); last loss at step {step}: "
                f"{lines}. Run the same command again to resume from the newest committed step"
            ) from error
        print(f"GRPO: recreating the job's actors (recovery {self.restarts})", flush=True)
        new = await self.start()
        self._pending = {"event": "recovery", "n": self.restarts, "failed_step": step,
                         "lost": sorted(dead), "reasons": dead, "t0": t0}  # fmt: skip
        return new

    def resumed(self, step: int, tier: str | None = None) -> None:
        """Called once the recreated job has loaded `step` (from `tier`: memory or durable):
        logs and records the recovery."""
        if self._pending is None:
            return
        event, self._pending = self._pending, None
        seconds = time.perf_counter() - event.pop("t0")
        event.update(resumed_step=step, tier=tier, recovery_s=round(seconds, 3))
        self.log.append_event(event)
        print(
            f"GRPO: recovered in {seconds:.1f}s: lost {', '.join(event['lost'])}; "
            f"continuing from committed step {step} ({tier or 'no'} checkpoint)",
            flush=True,
        )
