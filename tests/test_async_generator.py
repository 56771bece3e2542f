"""The async GRPO generators (apps/grpo/generator.py) cut mid-generation and resumed in fresh
actors, on one local Ray: every in-flight request continues from its saved tokens and sampler
state to completions (tokens and log-probs) bitwise equal to the uninterrupted ones, with 0
tokens decoded again, on 2 replicas and re-dealt to 3 (docs/async_rl.md). The harness is the
async_rl benchmark's workload (`benchmarks/async_rl/workload.py`)."""

from __future__ import annotations

import asyncio
import os
from argparse import Namespace

from benchmarks.async_rl.workload import Workload, in_flight_saved
from forge_ckpt import CheckpointConfig, CheckpointCoordinator


async def cut_and_resume(folder: str) -> tuple[list, list[dict]]:
    w = Workload(Namespace(replicas=2, requests=16, token_cost_ms=2.0))
    await w.start()
    coord = CheckpointCoordinator(CheckpointConfig(folder=folder))
    coord.register("generators", w.generators)
    await w.submit_batch()
    await w.wait_tokens(16 * 3)  # about 3 of a request's ~14 tokens: mid-sequence
    await coord.save(1)  # sync: committed when it returns; the generators keep decoding
    coord.close()
    await w.wait_idle()
    await w.collect()  # the uninterrupted completions
    captured = in_flight_saved(folder, 1)
    return captured, [await w.resume_counts(folder, 1, replicas) for replicas in (2, 3)]


def test_cut_between_tokens_resumes_every_request_bitwise(ray_local, tmp_path):
    captured, resumes = asyncio.run(cut_and_resume(os.path.join(tmp_path, "ckpt")))
    print("in flight at the cut (replica, seq, k, tokens so far):", captured)
    assert any(n > 0 for *_, n in captured), "no request was mid-sequence at the cut"
    for replicas, r in zip((2, 3), resumes, strict=True):
        assert r["completions_equal"], (replicas, r)
        assert r["regenerated_tokens_cut"] == 0, (replicas, r)
        assert r["decoded_after_resume"] == r["tokens_still_missing"] > 0
