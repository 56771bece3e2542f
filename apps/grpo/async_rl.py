"""`mode: async`: generators run up to `policy.max_policy_lag` versions behind the trainer, and a
checkpoint cuts through them without waiting for any generation (docs/async_rl.md).

Pipeline: data input (`DatasetActor`) -> `policy.replicas` `Generator`s (many requests each,
token by token, in their own threads) -> `RolloutQueue` -> reward + trainer -> weight push to
every generator. The driver loop, for step s = 1, 2, ...:

1. dispatch every step t <= s + L whose prompts are not dispatched yet (L = max_policy_lag):
   prompt j of step t has stream position seq = (t-1) * batch_size + j, goes to replica
   seq % replicas, and is generated with policy version max(0, t-1-L) (`version_for`);
2. move finished completions from the generators to the queue until step s's are all there;
3. train step s on them in (seq, k) order; push version s to every generator;
4. every `checkpoint.interval` steps, `coord.save(s)`: the dataset position, the queue, every
   generator's in-flight requests (partial tokens, sampler state), their weight versions (as
   references where the step already holds them) and the trainer. The generators keep decoding.

Everything a step trains on is a function of (config, seed): which weights, which sampler, which
order. Timing decides only when it is ready, never what it is.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import ray

from forge_ckpt import CheckpointCoordinator, spawn_trainer_ranks

from .generator import OWNER, Generator, replica_for
from .metrics import step_record
from .placement import Placement
from .rl import EPISODE_FIELDS, group_advantages
from .task import Vocab, encode_prompts

POLL_S = 0.005  # how often the driver moves finished completions while it waits for a step


def version_for(step: int, lag: int) -> int:
    """The policy version that generates step `step`'s prompts (the determinism rule)."""
    return max(0, step - 1 - lag)


class AsyncJob:
    """The actors of an async run (0 CPUs each in Ray's accounting, one torch thread)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        from .actors import RewardActor, shapes
        from .data import DatasetActor
        from .rollout_queue import RolloutQueue
        from .trainer import Trainer

        seed, task, model, pol = int(cfg["seed"]), cfg["task"], cfg["model"], cfg["policy"]
        opts = Placement(cfg).actor_options  # ray.placement: each call places the next actor
        self.batch, self.group = int(cfg["dataset"]["batch_size"]), int(pol["group_size"])
        self.lag = int(pol["max_policy_lag"])
        self.vocab, self.prompt_width = Vocab(task["alphabet"]), shapes(task)[0]
        n_data = int(cfg["dataset"]["replicas"])
        data_cls, gen_cls = ray.remote(DatasetActor), ray.remote(Generator)
        self.datasets = [
            data_cls.options(**opts()).remote(seed, task, cfg["dataset"], self.batch, k, n_data)
            for k in range(n_data)
        ]
        self.generators = [  # consecutive: replicas on different nodes where there are enough
            gen_cls.options(**opts()).remote(seed, task, model, pol, j)
            for j in range(int(pol["replicas"]))
        ]
        queue_cls = ray.remote(RolloutQueue).options(**opts())
        self.queue = queue_cls.remote(seed, self.batch * self.group)
        self.reward = ray.remote(RewardActor).options(**opts()).remote(seed)
        trainer_cfg = {**cfg["trainer"], "temperature": pol["temperature"]}
        world = int(cfg["trainer"]["world_size"])
        trainer_cls = ray.remote(Trainer).options(**opts())  # the ranks share one node
        self.ranks = spawn_trainer_ranks(trainer_cls, world, seed, task, model, trainer_cfg)
        ray.get([r.setup.remote() for r in self.ranks])

    def register(self, coord: CheckpointCoordinator, replace: bool = False) -> None:
        coord.set_trainer(self.ranks)
        coord.register("dataset", self.datasets, replace=replace)
        coord.register("generators", self.generators, replace=replace)  # Generator.reshard_states
        coord.register("queue", self.queue, replace=replace)
        coord.register("reward", self.reward, replace=replace)

    def named_actors(self) -> dict[str, Any]:
        named = {"actor 'queue'": self.queue, "actor 'reward'": self.reward}
        named.update({f"actor 'dataset' replica {k}": h for k, h in enumerate(self.datasets)})
        named.update({f"actor 'generators' replica {k}": h for k, h in enumerate(self.generators)})
        named.update({f"trainer rank {r}": h for r, h in enumerate(self.ranks)})
        return named

    async def push_weights(self) -> int:
        """The trainer's current weights to every generator; older than the lag are dropped."""
        version = await self.ranks[0].version.remote()
        ref = self.ranks[0].get_weights.remote()
        keep = version_for(version + 1, self.lag)
        await asyncio.gather(*(g.push_weights.remote(version, ref, keep) for g in self.generators))
        return version

    async def restore_weights(self) -> int:
        """After a load: fill every weight reference the generators restored, from the trainer
        (its version must be the one referenced) or from the owner replica."""
        version = await self.ranks[0].version.remote()
        trainer_ref = self.ranks[0].get_weights.remote()
        for g in self.generators:
            for v, source in (await g.missing_weights.remote()).items():
                if source == "trainer":
                    await g.fill_weights.remote(v, trainer_ref, "trainer", version)
                else:
                    held = self.generators[0].held_weights.remote(v)
                    await g.fill_weights.remote(v, held, OWNER, v)
        return version

    async def dispatch(self, step: int) -> None:
        """Step `step`'s prompts to the generators (see the module docstring's rule)."""
        batch = None
        for dataset in self.datasets:
            batch = dataset.next_batch.remote(batch)
        prompts = await batch  # type: ignore[misc]
        parts: list[list[dict]] = [[] for _ in self.generators]
        version = version_for(step, self.lag)
        for j, (pid, text, answer) in enumerate(
            zip(prompts["id"], prompts["prompt"], prompts["answer"], strict=True)
        ):
            seq = (step - 1) * self.batch + j
            tokens, valid = encode_prompts(self.vocab, [text], self.prompt_width)
            for k in range(self.group):
                parts[replica_for(seq, len(self.generators))].append(
                    {"seq": seq, "k": k, "step": step, "prompt_id": int(pid), "answer": answer,
                     "prompt": tokens[0], "prompt_valid": valid[0], "version": version}
                )  # fmt: skip
        await asyncio.gather(
            *(g.submit.remote(p) for g, p in zip(self.generators, parts, strict=True))
        )
        await self.queue.note_dispatched.remote(step)

    async def collect_until_ready(self, step: int) -> None:
        """Move finished completions into the queue until step `step` has all of its."""
        while True:
            done = await asyncio.gather(*(g.take_finished.remote() for g in self.generators))
            episodes = sorted((e for d in done for e in d), key=lambda e: (e["seq"], e["k"]))
            if episodes:
                await self.queue.put.remote(episodes)
            if await self.queue.ready.remote(step):
                return
            await asyncio.sleep(POLL_S)  # generators decode meanwhile; the result is the same


async def train_step(job: AsyncJob, step: int) -> dict[str, Any]:
    """Train step `step` on its completions (all in the queue), then push the new weights."""
    rollout = await job.queue.take.remote(step)
    rewards = await job.reward.score.remote(rollout)
    advantages = group_advantages(rewards, job.group)
    batch = {k: np.asarray(rollout[k]) for k in EPISODE_FIELDS if k in rollout}
    batch["reward"], batch["advantage"] = rewards, advantages
    results = await asyncio.gather(*(r.train_step.remote(batch) for r in job.ranks))
    await job.push_weights()
    stats = await job.reward.stats.remote()
    return {
        **step_record(step, results[0], rewards, stats, rollout),
        "completion_tokens": int(np.asarray(rollout["completion_mask"]).sum()),
        "rollout_prompt_ids": rollout["prompt_id"][:: job.group].tolist(),
    }


async def resume_and_train_async(
    job: AsyncJob,
    coord: CheckpointCoordinator,
    log: Any,
    sup: Any,
    cfg: dict[str, Any],
    stop: asyncio.Event,
    t0: float,
) -> tuple[int, int]:
    """Load the newest committed step (generators continue their in-flight requests from it)
    and train to `steps`; (resumed step, last step)."""
    import time

    from .progress import Progress

    loaded = await coord.load()
    start = loaded.step if loaded else 0
    log.truncate_after(start)
    sup.resumed(start, loaded.tier if loaded else None)
    if loaded is None:
        await job.push_weights()  # version 0 to every generator
    else:
        await job.restore_weights()
        inflight = await asyncio.gather(*(g.in_flight.remote(True) for g in job.generators))
        print(f"GRPO async: resumed in-flight requests {inflight}", flush=True)
    progress = Progress(start, int(cfg["steps"]), loaded is not None, time.perf_counter() - t0)
    steps, interval = int(cfg["steps"]), int(cfg["checkpoint"]["interval"])
    step = start
    with progress:
        while step < steps and not stop.is_set():
            step += 1
            for t in range(await job.queue.dispatched_steps.remote() + 1, step + job.lag + 1):
                await job.dispatch(t)
            await job.collect_until_ready(step)
            record = await train_step(job, step)
            log.append(record)
            progress.update(record)
            durable = step % interval == 0 or step == steps or stop.is_set()
            if durable or coord.config.memory_every:
                log.sync()
                await coord.save(step, extra={"policy_version": step}, durable=durable)
    await coord.wait()
    return start, step
