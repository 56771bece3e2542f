"""GRPO's two pieces of math: group-normalised advantages and the clipped objective.

An episode batch is a dict of equal-length numpy arrays (see `EPISODE_FIELDS`): plain arrays
travel through Ray and into checkpoints without pickling any object of ours.
"""

from __future__ import annotations

import numpy as np
import torch

from .model import token_logprobs

# name -> dtype of every per-episode array (first axis = episode).
EPISODE_FIELDS = {
    "prompt_id": np.int64,  # [N] stable id of the prompt in the dataset
    "prompt": np.int64,  # [N, P] left-padded prompt tokens
    "prompt_valid": np.bool_,  # [N, P]
    "completion": np.int64,  # [N, C] sampled tokens, pad after <eos>
    "completion_mask": np.bool_,  # [N, C] tokens up to and including <eos>
    "logprobs": np.float32,  # [N, C] log-probs under the policy that sampled them
    "reward": np.float32,  # [N]
    "advantage": np.float32,  # [N]
    "version": np.int64,  # [N] policy version that sampled the episode
}


def group_advantages(rewards: np.ndarray, group_size: int, eps: float = 1e-4) -> np.ndarray:
    """(reward - group mean) / (group std + eps), groups = consecutive `group_size` rewards.

    A group whose completions all score the same carries no signal: its advantages are 0.
    """
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)
    adv = (r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + eps)
    return adv.reshape(-1).astype(np.float32)


def to_tensors(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Tensors that own their memory (arrays from Ray's object store are read-only)."""
    return {k: torch.from_numpy(np.array(v, copy=True)) for k, v in batch.items()}


def grpo_loss(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    temperature: float,
    clip_eps: float,
    total_tokens: int,
    ref_model: torch.nn.Module | None = None,
    kl_beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate summed over this slice's completion tokens / `total_tokens`.

    Dividing by the token count of the whole (all-rank) batch makes the sum of the ranks'
    gradients the gradient of the global token mean, whatever the slicing.
    """
    tokens = torch.cat([batch["prompt"], batch["completion"]], dim=1)
    valid = torch.cat([batch["prompt_valid"], batch["completion_mask"]], dim=1)
    p = batch["prompt"].shape[1]
    new = token_logprobs(model, tokens, valid, temperature)[:, p - 1 :]
    mask = batch["completion_mask"].float()
    ratio = torch.exp(new - batch["logprobs"])
    adv = batch["advantage"][:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    per_token = -surrogate
    kl_sum = 0.0
    if ref_model is not None and kl_beta > 0:
        with torch.no_grad():
            ref = token_logprobs(ref_model, tokens, valid, temperature)[:, p - 1 :]
        kl = torch.exp(ref - new) - (ref - new) - 1  # k3 estimator, >= 0
        per_token = per_token + kl_beta * kl
        kl_sum = float((kl * mask).sum())
    loss = (per_token * mask).sum() / total_tokens
    clipped = ((ratio - 1).abs() > clip_eps).float()
    stats = {
        "clip_sum": float((clipped * mask).sum()),
        "kl_sum": kl_sum,
        "tokens": float(mask.sum()),
    }
    return loss, stats
