"""The rollout side of the job: Policy (generation), RewardActor (scoring), ReplayBuffer.

Each is a plain synchronous Ray actor: Ray runs its calls one at a time in the order one caller
submitted them, so once the main loop has awaited a step's calls, a checkpoint call sees the
state after that step (the consistent cut). State is plain containers and numpy arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from forge_ckpt import Checkpointable, immutable

from .model import build_model, sample
from .rl import EPISODE_FIELDS
from .seeding import derive_seed, seed_process
from .task import Vocab, decode_completion, encode_prompts, score


def shapes(task_cfg: dict) -> tuple[int, int]:
    """(prompt width, completion width): `<bos> letters =` and `sorted letters <eos>`."""
    max_len = int(task_cfg["max_len"])
    return max_len + 2, max_len + 1


class Policy(Checkpointable):
    """Samples `group_size` completions per prompt with its own `torch.Generator`.

    Weights are not part of its state: they come from the trainer (`update_weights`), also on
    resume, where the main loop pushes the restored weights before any rollout.

    `generate` keeps its rollout in the actor until `take_rollout` collects it. A rollout that
    is generated but not yet trained on (overlap mode) is therefore part of this actor's state
    at a checkpoint, and a resumed run trains on exactly the rollout the interrupted one had.
    """

    def __init__(self, seed: int, task_cfg: dict, model_cfg: dict, policy_cfg: dict) -> None:
        seed_process(seed, "policy")
        self.vocab = Vocab(task_cfg["alphabet"])
        self.prompt_width, self.completion_width = shapes(task_cfg)
        self.model = build_model(
            model_cfg, self.vocab.size, self.prompt_width + self.completion_width, seed
        ).eval()
        self.group_size = int(policy_cfg["group_size"])
        self.temperature = float(policy_cfg["temperature"])
        self.generator = torch.Generator().manual_seed(derive_seed(seed, "policy-sampling"))
        self.version = -1  # no weights received yet
        self.pending: dict[str, Any] | None = None

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        self.model.load_state_dict(state_dict)
        self.version = int(version)
        return self.version

    def generate(self, batch: dict[str, list]) -> int:
        """Sample completions for a dataset batch and hold them; returns the episode count."""
        if self.version < 0:
            raise RuntimeError("Policy.generate before update_weights: no weights yet")
        if self.pending is not None:
            raise RuntimeError("Policy.generate: the previous rollout was never taken")
        g = self.group_size
        prompts = [p for p in batch["prompt"] for _ in range(g)]
        tokens, valid = encode_prompts(self.vocab, prompts, self.prompt_width)
        out, mask, logprobs = sample(
            self.model,
            torch.from_numpy(tokens),
            torch.from_numpy(valid),
            max_new_tokens=self.completion_width,
            temperature=self.temperature,
            eos_id=self.vocab.eos_id,
            pad_id=self.vocab.pad_id,
            generator=self.generator,
        )
        out_np, mask_np = out.numpy(), mask.numpy()
        self.pending = {
            "prompt_id": np.repeat(np.asarray(batch["id"], dtype=np.int64), g),
            "prompt": tokens,
            "prompt_valid": valid,
            "completion": out_np,
            "completion_mask": mask_np,
            "logprobs": logprobs.numpy(),
            "version": np.full(len(prompts), self.version, dtype=np.int64),
            "answer": [a for a in batch["answer"] for _ in range(g)],
            "text": [
                decode_completion(self.vocab, o, m) for o, m in zip(out_np, mask_np, strict=True)
            ],
        }
        return len(prompts)

    def has_pending(self) -> bool:
        return self.pending is not None

    def take_rollout(self) -> dict[str, Any]:
        if self.pending is None:
            raise RuntimeError("Policy.take_rollout: no rollout was generated")
        rollout, self.pending = self.pending, None
        return rollout

    def rng_generators(self) -> dict[str, torch.Generator]:
        return {"sampling": self.generator}

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "pending": self.pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        pending = state["pending"]
        self.pending = None if pending is None else _own(pending)


class RewardActor(Checkpointable):
    """Scores completions against the answer (`task.score`) and keeps running statistics of
    every reward it has given (Welford: count, mean, M2)."""

    def __init__(self, seed: int) -> None:
        seed_process(seed, "reward")
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def score(self, rollout: dict[str, Any]) -> np.ndarray:
        rewards = np.array(
            [score(t, a) for t, a in zip(rollout["text"], rollout["answer"], strict=True)],
            dtype=np.float32,
        )
        for r in rewards.tolist():
            self.count += 1
            delta = r - self.mean
            self.mean += delta / self.count
            self.m2 += delta * (r - self.mean)
        return rewards

    def stats(self) -> dict[str, float]:
        var = self.m2 / (self.count - 1) if self.count > 1 else 0.0
        return {"count": self.count, "mean": self.mean, "std": var**0.5}

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), state["mean"], state["m2"]


class ReplayBuffer(Checkpointable):
    """Episodes as columns of numpy arrays (`rl.EPISODE_FIELDS`), sampled without replacement
    by its own `np.random.Generator`.

    `evict(version)` drops episodes sampled by a policy more than `max_policy_age` versions
    older than `version`, then the oldest beyond `capacity`; it returns the evicted episodes' prompt ids (each once).
    """

    def __init__(self, seed: int, replay_cfg: dict, task_cfg: dict) -> None:
        seed_process(seed, "replay")
        self.capacity = int(replay_cfg["capacity"])
        self.max_policy_age = int(replay_cfg["max_policy_age"])
        self.rng = np.random.default_rng(derive_seed(seed, "replay-sampling"))
        p, c = shapes(task_cfg)
        width = {"prompt": p, "prompt_valid": p, "completion": c, "completion_mask": c}
        width.update(logprobs=c)
        self.data = {
            k: np.zeros((0, width[k]) if k in width else (0,), dtype=dt)
            for k, dt in EPISODE_FIELDS.items()
        }
        self.added = 0

    def __len__(self) -> int:
        return len(self.data["prompt_id"])

    def size(self) -> int:
        return len(self)

    def add(self, rollout: dict[str, Any], reward: np.ndarray, advantage: np.ndarray) -> int:
        new = {k: np.asarray(rollout[k]) for k in EPISODE_FIELDS if k in rollout}
        new["reward"], new["advantage"] = np.asarray(reward), np.asarray(advantage)
        for k, dt in EPISODE_FIELDS.items():
            self.data[k] = np.concatenate([self.data[k], new[k].astype(dt, copy=False)])
        self.added += len(new["reward"])
        return len(self)

    def evict(self, current_version: int) -> list[int]:
        keep = self.data["version"] >= current_version - self.max_policy_age
        over = int(keep.sum()) - self.capacity
        if over > 0:  # episodes are stored oldest first: drop the oldest kept ones too
            keep[np.flatnonzero(keep)[:over]] = False
        evicted = list(dict.fromkeys(self.data["prompt_id"][~keep].tolist()))  # unique, in order
        self.data = {k: v[keep] for k, v in self.data.items()}
        return evicted

    def sample(self, batch_size: int) -> dict[str, np.ndarray]:
        """`batch_size` distinct episodes (all of them when fewer are held), in stored order."""
        n = len(self)
        if n == 0:
            raise RuntimeError("ReplayBuffer.sample on an empty buffer")
        idx = np.sort(self.rng.choice(n, size=min(batch_size, n), replace=False))
        return {k: v[idx] for k, v in self.data.items()}

    def rng_generators(self) -> dict[str, np.random.Generator]:
        return {"sampling": self.rng}

    def state_dict(self) -> dict[str, Any]:
        # add() and evict() replace the arrays, never change them in place: a background
        # snapshot need not copy them.
        return {"data": immutable(dict(self.data)), "added": self.added}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data = {k: np.array(state["data"][k], dtype=dt) for k, dt in EPISODE_FIELDS.items()}
        self.added = int(state["added"])


def _own(tree: Any) -> Any:
    """Writable copies of the arrays in a loaded tree (loaded ones may be read-only views)."""
    if isinstance(tree, dict):
        return {k: _own(v) for k, v in tree.items()}
    if isinstance(tree, np.ndarray):
        return np.array(tree)
    if isinstance(tree, list):
        return [_own(v) for v in tree]
    return tree
