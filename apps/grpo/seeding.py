"""Seeds derived from the run's one `seed`, so every component has its own stream.

Each actor also seeds its process-global RNGs (Python, numpy, torch): Ray may reuse a worker
process, and nothing may depend on what an earlier task left in them. The checkpoint mixin saves
and restores those global streams with the actor's state.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def derive_seed(seed: int, name: str) -> int:
    """A 63-bit seed for the stream `name` of the run seeded with `seed`."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_process(seed: int, name: str) -> None:
    """Seed this process's global RNGs for component `name`; use one CPU thread.

    One thread keeps float reductions in a fixed order (bitwise-reproducible runs) and keeps
    the job's actors from oversubscribing the machine's cores.
    """
    s = derive_seed(seed, f"process-{name}")
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    torch.set_num_threads(1)
