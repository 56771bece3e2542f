"""A small causal transformer in plain PyTorch, and sampling from it.

TorchTitan's models need flex/varlen attention, which cannot train on CPU; this one is a few
pre-norm blocks with plain matmul attention, small enough to learn the task in minutes on two
cores. Everything here is deterministic on CPU: weights are initialised from an explicit
`torch.Generator` (never the global RNG) and sampling draws from a generator the caller owns.

Sequences are left-padded: `valid` marks real tokens, positions count real tokens only, and a
padded position attends to itself alone (so no softmax row is empty).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    max_seq_len: int
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4

    @classmethod
    def from_config(cls, model_cfg: dict, vocab_size: int, max_seq_len: int) -> ModelArgs:
        return cls(
            vocab_size=vocab_size,
            max_seq_len=max_seq_len,
            d_model=int(model_cfg["d_model"]),
            n_layers=int(model_cfg["n_layers"]),
            n_heads=int(model_cfg["n_heads"]),
        )


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.norm1 = nn.LayerNorm(args.d_model)
        self.qkv = nn.Linear(args.d_model, 3 * args.d_model)
        self.proj = nn.Linear(args.d_model, args.d_model)
        self.norm2 = nn.LayerNorm(args.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(args.d_model, 4 * args.d_model),
            nn.GELU(),
            nn.Linear(4 * args.d_model, args.d_model),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (d // self.n_heads) ** -0.5
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        att = scores.softmax(dim=-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok = nn.Embedding(args.vocab_size, args.d_model)
        self.pos = nn.Embedding(args.max_seq_len, args.d_model)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, args.vocab_size)

    def init_weights(self, seed: int) -> None:
        """Deterministic init from `seed` alone: N(0, 0.02) matrices, zero biases, unit norms."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02, generator=gen)
                elif name.endswith("weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """tokens, valid: [B, T] (left-padded) -> logits [B, T, V]."""
        t = tokens.shape[1]
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        eye = torch.eye(t, dtype=torch.bool)
        mask = (causal & valid[:, None, :]) | eye
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def build_model(model_cfg: dict, vocab_size: int, max_seq_len: int, seed: int) -> TinyTransformer:
    model = TinyTransformer(ModelArgs.from_config(model_cfg, vocab_size, max_seq_len))
    model.init_weights(seed)
    return model


def token_logprobs(
    model: nn.Module, tokens: torch.Tensor, valid: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Log-probability of each token given the ones before it: [B, T-1] for tokens[:, 1:]."""
    logits = model(tokens, valid)[:, :-1] / temperature
    return torch.gather(F.log_softmax(logits, dim=-1), 2, tokens[:, 1:, None]).squeeze(2)


@torch.no_grad()
def sample(
    model: nn.Module,
    prompts: torch.Tensor,
    prompt_valid: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    eos_id: int,
    pad_id: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample completions token by token (no KV cache: sequences are a dozen tokens).

    Returns (tokens, mask, logprobs), each [B, max_new_tokens]: the sampled ids (`pad_id` after
    `<eos>`), which of them count (up to and including `<eos>`), and their log-probabilities
    under the sampling distribution (logits / temperature).
    """
    b = prompts.shape[0]
    tokens, valid = prompts, prompt_valid
    out = torch.full((b, max_new_tokens), pad_id, dtype=torch.long)
    mask = torch.zeros(b, max_new_tokens, dtype=torch.bool)
    logprobs = torch.zeros(b, max_new_tokens)
    alive = torch.ones(b, dtype=torch.bool)
    for i in range(max_new_tokens):
        logits = model(tokens, valid)[:, -1] / temperature
        logp = F.log_softmax(logits, dim=-1)
        nxt = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
        nxt = torch.where(alive, nxt, torch.full_like(nxt, pad_id))
        out[:, i], mask[:, i] = nxt, alive
        logprobs[:, i] = torch.where(alive, logp.gather(1, nxt[:, None]).squeeze(1), 0.0)
        alive = alive & (nxt != eos_id)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        valid = torch.cat([valid, mask[:, i : i + 1]], dim=1)
        if not alive.any():
            break
    return out, mask, logprobs


def load_exported(path: str, model_cfg: dict) -> TinyTransformer:
    """The policy from `forge-ckpt export ... --format safetensors PATH` (a local folder), so
    a serving or eval process needs no checkpoint machinery; vocabulary and context length
    come from the embeddings' shapes. Every key must match (strict)."""
    import json
    import os

    from safetensors.torch import load_file

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        state.update(load_file(os.path.join(path, shard)))
    vocab_size, max_seq_len = state["tok.weight"].shape[0], state["pos.weight"].shape[0]
    model = TinyTransformer(ModelArgs.from_config(model_cfg, vocab_size, max_seq_len))
    model.load_state_dict(state, strict=True)
    return model
