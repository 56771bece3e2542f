"""`RolloutQueue`: the finished rollouts of the asynchronous mode, waiting to be trained on.

Completions arrive in whatever order the generators finish them; the trainer takes them in
sequence order only: step s's rollout is the `batch_size x group_size` completions of its
prompts, ordered by (seq, k), handed out once all of them are here. The queue also records how
many steps' prompts were dispatched to generators, so the cut holds the data position, the
dispatched work and the finished work together. Its size is bounded by the driver's window
(`max_policy_lag + 1` steps ahead of the trainer).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from forge_ckpt import Checkpointable, immutable

from .seeding import seed_process

COLUMNS = ("prompt_id", "prompt", "prompt_valid", "completion", "completion_mask", "logprobs")


class RolloutQueue(Checkpointable):
    def __init__(self, seed: int, per_step: int) -> None:
        seed_process(seed, "rollout-queue")
        self.per_step = per_step  # completions a step trains on
        self.items: dict[tuple[int, int], dict[str, Any]] = {}
        self.dispatched = 0  # steps whose prompts went to the generators

    def note_dispatched(self, step: int) -> int:
        if step != self.dispatched + 1:
            raise RuntimeError(f"dispatch of step {step} after step {self.dispatched}")
        self.dispatched = step
        return step

    def dispatched_steps(self) -> int:
        return self.dispatched

    def put(self, episodes: list[dict[str, Any]]) -> int:
        for e in episodes:
            key = (int(e["seq"]), int(e["k"]))
            if key in self.items:
                raise RuntimeError(f"completion {key} arrived twice")
            self.items[key] = e
        return len(self.items)

    def ready(self, step: int) -> bool:
        return sum(1 for e in self.items.values() if int(e["step"]) == step) == self.per_step

    def take(self, step: int) -> dict[str, Any]:
        """Step `step`'s completions as episode columns, in (seq, k) order."""
        keys = sorted(k for k, e in self.items.items() if int(e["step"]) == step)
        if len(keys) != self.per_step:
            raise RuntimeError(f"step {step}: {len(keys)} of {self.per_step} completions here")
        eps = [self.items.pop(k) for k in keys]
        out: dict[str, Any] = {c: np.stack([np.asarray(e[c]) for e in eps]) for c in COLUMNS}
        out["version"] = np.array([int(e["version"]) for e in eps], dtype=np.int64)
        out["seq"] = np.array([int(e["seq"]) for e in eps], dtype=np.int64)
        out["answer"] = [e["answer"] for e in eps]
        out["text"] = [e["text"] for e in eps]
        return out

    def size(self) -> int:
        return len(self.items)

    def state_dict(self) -> dict[str, Any]:
        # put() and take() add and remove entries, never change one: no copy needed.
        items = [self.items[k] for k in sorted(self.items)]
        return {"items": immutable(items), "dispatched": self.dispatched}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.items = {(int(e["seq"]), int(e["k"])): dict(e) for e in state["items"]}
        self.dispatched = int(state["dispatched"])
