"""GRPO on Ray with exact resume: `python -m apps.grpo.main --config configs/grpo.yaml [k=v ...]`.

One step: dataset batch -> policy samples a group of completions per prompt -> reward ->
group-normalised advantages -> replay buffer (add, evict stale, sample) -> every trainer rank
trains on the sample -> new weights to the policy -> one line in metrics.jsonl -> every
`checkpoint.interval` steps a checkpoint of the trainer and every actor, committed atomically.

Running the same command again resumes from the newest committed step and, from there, computes
exactly what the uninterrupted run computes; `fresh=true` starts over. SIGTERM finishes the
current step, commits a checkpoint at it and exits 0.

The consistent cut: every actor call of a step is awaited before `coord.save`, so each actor's
snapshot holds the state after that step and nothing later.

`mode=async` runs the asynchronous pipeline of async_rl.py instead of this loop (generators up
to `policy.max_policy_lag` versions behind, checkpoints that cut through in-flight generations;
docs/async_rl.md).

Overlap (`overlap=true`): the rollout for step N+1 is generated (by the weights of step N-1)
while step N trains. At a checkpoint the in-flight generation is drained (awaited), and the
rollout it produced stays inside the Policy actor (`Policy.pending`), whose state is saved: a
resumed run trains step N+1 on that very rollout instead of generating a new one. The dataset
cursor in the same checkpoint already counts that rollout's prompts, so nothing is skipped or
repeated. The last step launches the next rollout too, so a run resumed with more `steps`
matches one that ran them all at once.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on 127.0.0.1 only

import ray  # noqa: E402

from forge_ckpt import (  # noqa: E402
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointError,
    CheckpointMismatchError,
)

from .async_rl import AsyncJob, resume_and_train_async  # noqa: E402
from .chaos import chaos_hold, chaos_hook  # noqa: E402
from .config import ConfigError, fingerprint, load_config  # noqa: E402
from .metrics import EventsLog, MetricsLog, step_record  # noqa: E402
from .placement import Placement  # noqa: E402
from .progress import Progress, summary  # noqa: E402
from .rl import group_advantages  # noqa: E402
from .supervisor import RecoveryError, Supervisor  # noqa: E402

CHECKPOINTS, METRICS, FINAL_WEIGHTS = "checkpoints", "metrics.jsonl", "final_weights.safetensors"
EVENTS = "events.jsonl"  # forge_ckpt's checkpoint events (apps/grpo/metrics.py EventsLog)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m apps.grpo.main",
        description="GRPO on Ray with exact resume from forge_ckpt checkpoints.",
    )
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/grpo.yaml")
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides: steps=50 seed=1"
    )
    return parser.parse_args(argv)


def start_ray(cfg: dict[str, Any]) -> None:
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "OMP_NUM_THREADS": "1"}
    common = {"runtime_env": {"env_vars": env}, "log_to_driver": True, "logging_level": "WARNING"}
    if cfg["ray"].get("address"):  # join a running cluster; this job's actors die with it
        ray.init(address=cfg["ray"]["address"], **common)
        return
    for attempt in range(3):  # Ray gives its raylet a fixed 30 s: too short on a busy machine
        try:
            ray.init(
                address="local",
                num_cpus=int(cfg["ray"]["num_cpus"]),
                include_dashboard=False,
                object_store_memory=int(cfg["ray"]["object_store_mb"]) * 1024**2,
                **common,
            )
            return
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
            print(f"Ray did not start ({e}); retrying", flush=True)
            ray.shutdown()


class Job:
    """The actors of one run; all use 0 CPUs in Ray's accounting (each runs one torch thread)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        from forge_ckpt import spawn_trainer_ranks

        from .actors import Policy, ReplayBuffer, RewardActor
        from .data import DatasetActor
        from .trainer import Trainer

        seed, task, model = int(cfg["seed"]), cfg["task"], cfg["model"]
        opts = Placement(cfg).actor_options  # ray.placement: each call places the next actor
        batch, replicas = int(cfg["dataset"]["batch_size"]), int(cfg["dataset"]["replicas"])
        dataset_cls = ray.remote(DatasetActor)
        self.datasets = [  # one component; each replica serves batch/replicas prompts a step
            dataset_cls.options(**opts()).remote(seed, task, cfg["dataset"], batch, k, replicas)
            for k in range(replicas)
        ]
        self.policy = ray.remote(Policy).options(**opts()).remote(seed, task, model, cfg["policy"])
        self.reward = ray.remote(RewardActor).options(**opts()).remote(seed)
        self.replay = ray.remote(ReplayBuffer).options(**opts()).remote(seed, cfg["replay"], task)
        trainer_cfg = {**cfg["trainer"], "temperature": cfg["policy"]["temperature"]}
        self.ranks = spawn_trainer_ranks(
            ray.remote(Trainer).options(**opts()),  # the ranks share one node
            int(cfg["trainer"]["world_size"]),
            seed,
            task,
            model,
            trainer_cfg,
        )
        ray.get([r.setup.remote() for r in self.ranks])

    def register(self, coord: CheckpointCoordinator, replace: bool = False) -> None:
        coord.set_trainer(self.ranks)
        coord.register("dataset", self.datasets, replace=replace)  # DatasetActor.reshard_states
        coord.register("policy", self.policy, replace=replace)
        coord.register("reward", self.reward, replace=replace)
        coord.register("replay", self.replay, replace=replace)

    async def push_weights(self) -> int:
        """Send rank 0's weights and version to the policy (the ref never visits the driver)."""
        version = await self.ranks[0].version.remote()
        await self.policy.update_weights.remote(self.ranks[0].get_weights.remote(), version)
        return version


class Rollouts:
    """Launches generation and hands out rollouts; with overlap, one generation runs ahead."""

    def __init__(self, job: Job, overlap: bool) -> None:
        self.job, self.overlap = job, overlap
        self.inflight: ray.ObjectRef | None = None

    def launch(self) -> None:
        batch = None  # the replicas' parts in replica order, chained so no call waits here
        for dataset in self.job.datasets:
            batch = dataset.next_batch.remote(batch)
        self.inflight = self.job.policy.generate.remote(batch)

    async def drain(self) -> None:
        """Await the in-flight generation; its rollout then sits in the Policy's state."""
        if self.inflight is not None:
            inflight, self.inflight = self.inflight, None
            await inflight

    async def next(self) -> dict[str, Any]:
        """The rollout to train on now (resumed from the Policy's state if it holds one)."""
        await self.drain()
        if not await self.job.policy.has_pending.remote():
            self.launch()
            await self.drain()
        rollout = await self.job.policy.take_rollout.remote()
        if self.overlap:
            self.launch()  # runs while this step trains
        return rollout


async def train_step(job: Job, rollouts: Rollouts, cfg: dict[str, Any], step: int) -> dict:
    rollout = await rollouts.next()
    rewards = await job.reward.score.remote(rollout)
    advantages = group_advantages(rewards, int(cfg["policy"]["group_size"]))
    await job.replay.add.remote(rollout, rewards, advantages)
    version = await job.ranks[0].version.remote()
    evicted = await job.replay.evict.remote(version)
    batch_ref = job.replay.sample.remote(int(cfg["replay"]["sample_size"]))
    results = await asyncio.gather(*(r.train_step.remote(batch_ref) for r in job.ranks))
    batch = await batch_ref
    await job.push_weights()
    stats = await job.reward.stats.remote()
    return {
        **step_record(step, results[0], rewards, stats, rollout),
        "rollout_prompt_ids": rollout["prompt_id"][:: int(cfg["policy"]["group_size"])].tolist(),
        "trained_prompt_ids": batch["prompt_id"].tolist(),
        "evicted_prompt_ids": evicted,
    }


def checkpoint_folder(cfg: dict[str, Any]) -> str:
    """`checkpoint.folder` (a local path or s3://bucket/prefix), else `<run_dir>/checkpoints`."""
    return cfg["checkpoint"].get("folder") or os.path.join(cfg["run_dir"], CHECKPOINTS)


def prepare_run_dir(cfg: dict[str, Any]) -> None:
    run_dir = cfg["run_dir"]
    if cfg.get("fresh"):
        folder, memory = checkpoint_folder(cfg), int(memory_tier(cfg))
        # With the memory tier on, its holders (detached, named after the folder) may keep
        # memory steps of the last run even where the folder is gone: those are wiped too.
        if folder.startswith("s3://") or os.path.isdir(folder) or memory:
            # Taking the folder's lease first: a live run that uses it is not wiped under it.
            config = CheckpointConfig(
                folder=folder, memory_every=memory, fingerprint=fingerprint(cfg)
            )
            CheckpointCoordinator(config).wipe()
        for name in (METRICS, FINAL_WEIGHTS, EVENTS):
            if os.path.exists(os.path.join(run_dir, name)):
                os.remove(os.path.join(run_dir, name))
    os.makedirs(run_dir, exist_ok=True)


def memory_tier(cfg: dict[str, Any]) -> bool:
    """`checkpoint.memory`: auto turns the memory tier on when Ray has more than one node
    (on one node a copy in another process's memory dies with the machine anyway)."""
    memory = cfg["checkpoint"].get("memory", "auto")
    if memory == "auto":
        return sum(1 for n in ray.nodes() if n["Alive"]) > 1
    if not isinstance(memory, bool):
        raise ConfigError(f"checkpoint.memory must be auto, true or false, got {memory!r}")
    return memory


def make_coordinator(cfg: dict[str, Any]) -> CheckpointCoordinator:
    """The run's coordinator; it locks the checkpoint folder (one live job per folder). With
    the memory tier, every step is saved to memory and every `interval`-th also durably."""
    ckpt = cfg["checkpoint"]
    memory = memory_tier(cfg)
    config = CheckpointConfig(
        folder=checkpoint_folder(cfg),
        keep_last=ckpt["keep_last"],
        async_mode=ckpt["async_mode"],
        fingerprint=fingerprint(cfg),
        memory_every=int(memory),
        memory_copies=int(ckpt.get("memory_copies", 2)),
        on_event=EventsLog(os.path.join(cfg["run_dir"], EVENTS)),
    )
    if memory:
        print(f"checkpoints: every step to memory ({config.memory_copies} copies on other "
              f"nodes), every {ckpt['interval']} steps to {config.folder}", flush=True)  # fmt: skip
    return CheckpointCoordinator(config)


async def run(cfg: dict[str, Any]) -> int:
    stop = asyncio.Event()
    grace = float(cfg["checkpoint"]["sigterm_grace_s"])
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm, stop, grace, cfg)
    coord = make_coordinator(cfg)
    log = MetricsLog(os.path.join(cfg["run_dir"], METRICS))
    is_async = cfg.get("mode", "sync") == "async"  # docs/async_rl.md
    sup = Supervisor(cfg, coord, (lambda: AsyncJob(cfg)) if is_async else (lambda: Job(cfg)), log)
    resume = resume_and_train_async if is_async else resume_and_train
    t0 = time.perf_counter()
    try:
        job = await sup.start()
        while True:  # once, unless an actor or node is lost: then the supervisor rebuilds
            try:
                start, step = await resume(job, coord, log, sup, cfg, stop, t0)
                break
            except Exception as e:
                t0 = time.perf_counter()  # "actors ready in" then counts the whole recovery
                job = await sup.recover(job, e, log.last_step + 1)
        await coord.aclose()  # releases the folder's lease (the last save was flushed)
        if coord.tier is not None and step == int(cfg["steps"]):
            coord.tier.shutdown()  # the run is over and its last step durable: free the memory
        if stop.is_set() and step < int(cfg["steps"]):
            done = f"committed step {step}" if step > start else "no step ran, nothing saved"
            print(f"SIGTERM: {done}; run the same command again to continue")
            return 0
        await write_final_weights(job, os.path.join(cfg["run_dir"], FINAL_WEIGHTS))
        print(summary(log.read(), cfg["run_dir"]))
        return 0
    finally:
        coord.close()


async def resume_and_train(
    job: Job,
    coord: CheckpointCoordinator,
    log: MetricsLog,
    sup: Supervisor,
    cfg: dict[str, Any],
    stop: asyncio.Event,
    t0: float,
) -> tuple[int, int]:
    """Load the newest committed step (if any) and train to the end; (resumed step, last)."""
    loaded = await coord.load()  # restores every actor and the trainer, or None
    start = loaded.step if loaded else 0
    log.truncate_after(start)
    sup.resumed(start, loaded.tier if loaded else None)
    await job.push_weights()  # restored (or initial) weights before any rollout
    ready = time.perf_counter() - t0
    progress = Progress(start, int(cfg["steps"]), resumed=loaded is not None, ready_s=ready)
    with progress:
        step = await train_loop(job, coord, log, progress, cfg, start, stop)
    await coord.wait()  # a background save's failure is raised here, inside supervision
    return start, step


def on_sigterm(stop: asyncio.Event, grace_s: float, cfg: dict[str, Any]) -> None:
    """Finish the step, commit it, exit 0; if that cannot happen within `grace_s` (the
    scheduler's SIGKILL would come next), exit 1 naming the step that will be resumed."""
    if stop.is_set():
        return
    stop.set()

    def overdue() -> None:
        from forge_ckpt import committed_steps

        newest = (committed_steps(checkpoint_folder(cfg)) or [None])[-1]
        print(
            f"SIGTERM: no commit within the grace period of {grace_s:.0f}s; exiting. "
            f"The newest committed step is {newest}: the next start resumes from it.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    asyncio.get_running_loop().call_later(grace_s, overdue)


async def train_loop(
    job: Job,
    coord: CheckpointCoordinator,
    log: MetricsLog,
    progress: Progress,
    cfg: dict[str, Any],
    start: int,
    stop: asyncio.Event,
) -> int:
    """Steps start+1 .. `steps` (or until SIGTERM); returns the last step trained."""
    steps, interval = int(cfg["steps"]), int(cfg["checkpoint"]["interval"])
    rollouts = Rollouts(job, bool(cfg["overlap"]))
    step = start
    while step < steps and not stop.is_set():
        step += 1
        record = await train_step(job, rollouts, cfg, step)
        log.append(record)
        chaos_hook(job, step)  # tests: GRPO_CHAOS_KILL=name@step kills an actor once
        progress.update(record)
        durable = step % interval == 0 or step == steps or stop.is_set()
        if durable or coord.config.memory_every:  # with the memory tier: every step
            await rollouts.drain()  # the consistent cut: nothing of this step is in flight
            log.sync()
            extra = {"policy_version": record["policy_version"]}
            await coord.save(step, extra=extra, durable=durable)
        else:
            await chaos_hold(step, stop)  # tests: GRPO_CHAOS_HOLD=between_saves
    return step


async def write_final_weights(job: Job, path: str) -> None:
    from safetensors.torch import save_file

    weights = await job.ranks[0].get_weights.remote()
    save_file({k: v.contiguous() for k, v in weights.items()}, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.get("mode", "sync") not in ("sync", "async"):
            raise ConfigError(f"mode must be sync or async, got {cfg['mode']!r}")
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        start_ray(cfg)  # first: `fresh` wipes the memory tier's steps too
        prepare_run_dir(cfg)
        print(f"Ray started in {time.perf_counter() - t0:.1f}s", flush=True)
        code = asyncio.run(run(cfg))
    except CheckpointMismatchError as e:
        print(f"error: {cfg['run_dir']} cannot be resumed by this config.\n{e}", file=sys.stderr)
        print("(use another run_dir, or fresh=true to start this one over)", file=sys.stderr)
        return 2
    except (CheckpointError, RecoveryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    print(f"wall time {time.perf_counter() - t0:.1f}s")
    return code


if __name__ == "__main__":
    sys.exit(main())
