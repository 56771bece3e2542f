"""The generators of the async_rl benchmark: the GRPO app's `Generator` actors with a longer
task (completions of up to 25 tokens, ending at a sampled `<eos>`: lengths vary widely)."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

import ray

from apps.grpo.actors import shapes
from apps.grpo.generator import Generator, replica_for
from apps.grpo.model import build_model
from apps.grpo.task import Vocab, encode_prompts, make_letters, prompt_text
from forge_ckpt import CheckpointConfig, CheckpointCoordinator, serialization
from forge_ckpt.steps import layout

TASK = {"alphabet": "abcdefghij", "min_len": 4, "max_len": 24}
MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 4}
GROUP, SEED, POLL_S = 4, 0, 0.002


class Workload:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.policy = {"temperature": 1.0, "token_cost_ms": args.token_cost_ms}
        self.vocab, self.width = Vocab(TASK["alphabet"]), shapes(TASK)[0]
        self.next_seq = 0
        self.done: dict[tuple[int, int], dict[str, Any]] = {}
        self.generators: list[Any] = []
        p, c = shapes(TASK)
        self.weights = build_model(MODEL, self.vocab.size, p + c, SEED).state_dict()

    async def start(self) -> None:
        self.generators = self._spawn()
        await asyncio.gather(*(g.push_weights.remote(0, self.weights, 0) for g in self.generators))

    def _spawn(self, replicas: int | None = None) -> list[Any]:
        cls = ray.remote(Generator).options(num_cpus=0)
        n = replicas or self.args.replicas
        return [cls.remote(SEED, TASK, MODEL, self.policy, j) for j in range(n)]

    async def submit_batch(self) -> None:
        parts: list[list[dict]] = [[] for _ in self.generators]
        for _ in range(self.args.requests // GROUP):
            seq, self.next_seq = self.next_seq, self.next_seq + 1
            letters = make_letters(SEED, seq, TASK["alphabet"], TASK["min_len"], TASK["max_len"])
            tokens, valid = encode_prompts(self.vocab, [prompt_text(letters)], self.width)
            for k in range(GROUP):
                parts[replica_for(seq, len(self.generators))].append(
                    {"seq": seq, "k": k, "step": seq, "prompt_id": seq, "answer": "",
                     "prompt": tokens[0], "prompt_valid": valid[0], "version": 0}
                )  # fmt: skip
        self._base = await self.decoded()
        await asyncio.gather(
            *(g.submit.remote(p) for g, p in zip(self.generators, parts, strict=True))
        )

    @property
    def batch_tokens(self) -> int:
        return self.args.requests * 8  # about half of a batch's tokens: mid-generation

    async def decoded(self, generators: list[Any] | None = None, since_load: bool = False) -> int:
        gens = generators or self.generators
        return sum(await asyncio.gather(*(g.decoded.remote(since_load) for g in gens)))

    async def wait_tokens(self, n: int) -> None:
        while await self.decoded() - self._base < n:
            await asyncio.sleep(POLL_S)

    async def in_flight(self, generators: list[Any] | None = None) -> list[tuple]:
        gens = generators or self.generators
        return [r for rs in await asyncio.gather(*(g.in_flight.remote() for g in gens)) for r in rs]

    async def wait_idle(self, generators: list[Any] | None = None) -> None:
        while await self.in_flight(generators):
            await asyncio.sleep(POLL_S)

    async def collect(self, generators: list[Any] | None = None) -> dict[tuple[int, int], Any]:
        gens = generators or self.generators
        got = {}
        for eps in await asyncio.gather(*(g.take_finished.remote() for g in gens)):
            got.update({(int(e["seq"]), int(e["k"])): e for e in eps})
        if generators is None:
            self.done.update(got)
        return got

    async def resume_counts(
        self, folder: str, step: int, replicas: int | None = None
    ) -> dict[str, Any]:
        """Load `step` into fresh generators (`replicas` of them: the saved count by default),
        let them finish, count the tokens they decoded, compare their completions."""
        fresh = self._spawn(replicas)
        coord = CheckpointCoordinator(CheckpointConfig(folder=folder))
        coord.register("generators", fresh)
        await coord.load(step=step)
        coord.close()
        for g in fresh:
            for v in await g.missing_weights.remote():
                await g.fill_weights.remote(v, self.weights, "trainer", v)
        inflight = in_flight_saved(folder, step)  # as the step holds them
        await self.wait_idle(fresh)
        after = await self.decoded(fresh, since_load=True)
        got = await self.collect(fresh)
        missing = sum(
            int(self.done[(s, k)]["completion_mask"].sum()) - n for _, s, k, n in inflight
        )
        same = all(
            (got[key][c] == self.done[key][c]).all()
            for key in got
            for c in ("completion", "logprobs")
        )
        return {
            "requests_in_flight": len(inflight),
            "partial_tokens": sum(n for *_, n in inflight),
            "tokens_still_missing": missing,
            "decoded_after_resume": after,
            "regenerated_tokens_cut": after - missing,
            "regenerated_tokens_discard": sum(n for *_, n in inflight),
            "completions_equal": bool(same and got),
        }


def in_flight_saved(folder: str, step: int) -> list[tuple[int, int, int, int]]:
    """(replica, seq, k, tokens so far) of every unfinished request that committed step
    `step` of the local `folder` holds (the files of the component "generators")."""
    out = []
    comp = layout.read_committed(folder, step).components["generators"]
    for j, rec in sorted(layout.replica_files(comp, "generators").items()):
        state = serialization.load(os.path.join(layout.step_dir(folder, step), rec.path))["state"]
        out += [(j, int(r["seq"]), int(r["k"]), len(r["out"])) for r in state["active"]]
    return out
