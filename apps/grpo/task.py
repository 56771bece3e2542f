"""The verifiable task: sort a short string of letters.

A prompt is `<bos> d b c a =`; the right completion is `a b c d <eos>`. Tokens are characters.
The reward is checked by code, never learned: an exact answer scores 1, anything else gets
partial credit for each position that holds the right letter, which gives a tiny policy that
starts from random weights a gradient to climb from the first step.

Prompts are a pure function of (seed, index): the dataset holds no RNG, so a dataloader worker
can build any item in any order and every run sees the same prompt under the same id.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from torch.utils.data import Dataset

PAD, BOS, SEP, EOS = "_", "^", "=", "$"
SPECIALS = (PAD, BOS, SEP, EOS)


@dataclass(frozen=True)
class Vocab:
    """Character vocabulary: the four specials, then the task's alphabet."""

    alphabet: str

    @property
    def chars(self) -> tuple[str, ...]:
        return SPECIALS + tuple(self.alphabet)

    @property
    def size(self) -> int:
        return len(self.chars)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def eos_id(self) -> int:
        return self.chars.index(EOS)

    def encode(self, text: str) -> list[int]:
        index = {c: i for i, c in enumerate(self.chars)}
        return [index[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


def make_letters(seed: int, index: int, alphabet: str, min_len: int, max_len: int) -> str:
    """The letters of prompt `index`: its own generator, seeded by (seed, index)."""
    rng = np.random.default_rng([seed, index])
    n = int(rng.integers(min_len, max_len + 1))
    return "".join(alphabet[int(i)] for i in rng.integers(0, len(alphabet), size=n))


def prompt_text(letters: str) -> str:
    return f"{BOS}{letters}{SEP}"


def answer_text(letters: str) -> str:
    return "".join(sorted(letters))


class SortDataset(Dataset):
    """Map-style dataset of `size` prompts; item = {"id", "prompt", "answer"}."""

    def __init__(self, seed: int, size: int, alphabet: str, min_len: int, max_len: int) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        self.seed, self.size = seed, size
        self.alphabet, self.min_len, self.max_len = alphabet, min_len, max_len

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        letters = make_letters(self.seed, index, self.alphabet, self.min_len, self.max_len)
        return {"id": int(index), "prompt": prompt_text(letters), "answer": answer_text(letters)}

    def content_hash(self) -> str:
        """Hash of the parameters that define every item (the dataset's identity)."""
        key = f"{self.seed}|{self.size}|{self.alphabet}|{self.min_len}|{self.max_len}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]


def collate(items: list[dict]) -> dict:
    """Batch of items -> dict of lists (module level: dataloader workers must import it)."""
    return {key: [item[key] for item in items] for key in ("id", "prompt", "answer")}


def score(completion: str, answer: str) -> float:
    """1.0 for the exact answer; else the fraction of positions that hold the right letter.

    `completion` is the text before `<eos>` (all generated text when no `<eos>` came). The
    fraction is over the longer of the two, so extra letters cost credit as missing ones do.
    """
    if completion == answer:
        return 1.0
    hits = sum(a == b for a, b in zip(completion, answer, strict=False))
    return 0.5 * hits / max(len(completion), len(answer), 1)


def encode_prompts(vocab: Vocab, prompts: list[str], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad encoded prompts to `width`: (tokens int64 [N, width], valid bool [N, width])."""
    tokens = np.full((len(prompts), width), vocab.pad_id, dtype=np.int64)
    valid = np.zeros((len(prompts), width), dtype=np.bool_)
    for row, text in enumerate(prompts):
        ids = vocab.encode(text)
        if len(ids) > width:
            raise ValueError(f"prompt {text!r} is longer than {width} tokens")
        tokens[row, width - len(ids) :] = ids
        valid[row, width - len(ids) :] = True
    return tokens, valid


def decode_completion(vocab: Vocab, ids: np.ndarray, mask: np.ndarray) -> str:
    """The text of a completion before its <eos> (the whole sample when none came)."""
    out = []
    for tok, keep in zip(ids.tolist(), mask.tolist(), strict=True):
        if not keep or tok == vocab.eos_id:
            break
        out.append(vocab.chars[tok])
    return "".join(out)
