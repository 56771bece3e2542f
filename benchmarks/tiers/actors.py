"""The actors of `python -m benchmarks.tiers`: one holding the large tensor state under test,
one small one (a job's other actor). Each computes a digest of its own state in its own
process, so every load is checked bitwise without moving the state through the driver.

`Probe` measures the path the memory tier's bytes take, without forge_ckpt: `ray.put` in one
node's worker, `ray.get` in another node's, CRC32C there (the floor of one copy's cost).

Light on purpose: every actor is its own process, so this module imports forge_ckpt's actor
side, ray, torch, numpy and crc32c only.
"""

from __future__ import annotations

import gc
import hashlib
import os
import time
from typing import Any

import crc32c
import numpy as np
import ray
import torch

from forge_ckpt import Checkpointable

from ..timers import take_phases, timed

TENSORS = 16  # the state is this many float32 tensors (a model's layers, say)


def install_timers() -> None:
    """Time the memory tier's steps in this process: a writer's close (after its last byte:
    the holders' acks, and placing what the streams did not), and reading a file back."""
    from forge_ckpt.memory.store import MemoryStorage
    from forge_ckpt.memory.writer import MemWriter

    cls: Any = MemoryStorage
    cls.put_copies = timed("mem_put_copies", cls.put_copies)
    writer: Any = MemWriter
    writer.close = timed("mem_close", writer.close)
    cls._read = timed("mem_read", cls._read)


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """CRC32C of every tensor's bytes, with its name, dtype and shape (~10 GB/s: cheap next to
    the load it checks; each save uses a fresh seed, so a stale state cannot match)."""
    parts = []
    for name, t in tensors.items():
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data
        parts.append(f"{name}:{t.dtype}:{tuple(t.shape)}:{crc32c.crc32c(raw):08x}")
    return ";".join(parts)


def rng_digest(rng: np.random.Generator) -> str:
    """The generator's full state: a load must restore the RNG stream too."""
    return hashlib.blake2b(repr(rng.bit_generator.state).encode(), digest_size=8).hexdigest()


class TensorState(Checkpointable):
    """A model-like state: `TENSORS` float32 tensors of `nbytes` in total, a little metadata and
    a numpy generator (saved by forge_ckpt's RNG capture)."""

    def __init__(self) -> None:
        install_timers()
        self.tensors: dict[str, torch.Tensor] = {}
        self.meta: dict[str, Any] = {}
        self.rng = np.random.default_rng(0)

    def rng_generators(self) -> dict[str, Any]:
        return {"rng": self.rng}

    def state_dict(self) -> dict[str, Any]:
        return {"tensors": self.tensors, "meta": self.meta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tensors = dict(state["tensors"])
        self.meta = dict(state["meta"])

    def fill(self, nbytes: int, seed: int) -> str:
        """Hold `nbytes` of fresh values drawn from `seed`; returns the digest to expect."""
        self.drop()
        g = torch.Generator().manual_seed(seed)
        each = max(nbytes // TENSORS // 4, 1)
        self.tensors = {
            f"layer{i}.weight": torch.empty(each).uniform_(generator=g) for i in range(TENSORS)
        }
        self.meta = {"seed": seed, "elements": each * TENSORS}
        self.rng = np.random.default_rng(seed)
        self.rng.random(seed % 97 + 1)
        return self.digest()

    def drop(self) -> None:
        """Forget the state (before a load: a load that restores nothing cannot pass)."""
        self.tensors, self.meta = {}, {}
        self.rng = np.random.default_rng(2**31 - 1)
        gc.collect()

    def digest(self) -> str:
        return f"{tensor_digest(self.tensors)}|{sorted(self.meta.items())}|{rng_digest(self.rng)}"

    def ping(self) -> int:
        return os.getpid()

    # The protocol calls, timed: the actor's share of a save or load (the rest is the driver's).
    def forge_begin_save(self, *args: Any, **kwargs: Any) -> dict:
        return timed("actor_save", super().forge_begin_save)(*args, **kwargs)

    def forge_prepare_load(self, *args: Any, **kwargs: Any) -> list[str]:
        return timed("actor_prepare_load", super().forge_prepare_load)(*args, **kwargs)

    def forge_apply_load(self) -> None:
        timed("actor_apply_load", super().forge_apply_load)()

    def phases(self) -> dict[str, float]:
        """Seconds per phase since the last call (then reset)."""
        return take_phases()["seconds"]


class SmallState(Checkpointable):
    """A job's small actor (a dataloader's position, a reward model's counters): a few numbers,
    a short array and its generator."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)
        self.history: list[float] = []
        self.table = np.zeros(4096, dtype=np.float32)

    def rng_generators(self) -> dict[str, Any]:
        return {"rng": self.rng}

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "table": self.table}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = list(state["history"])
        self.table = np.array(state["table"])

    def advance(self, seed: int, steps: int = 100) -> str:
        """Draw `steps` values from a generator seeded `seed`; returns the digest to expect."""
        self.rng = np.random.default_rng(seed)
        self.history = [float(x) for x in self.rng.random(steps)]
        self.table = self.rng.random(4096).astype(np.float32)
        return self.digest()

    def digest(self) -> str:
        h = hashlib.blake2b(repr(self.history).encode(), digest_size=8)
        h.update(self.table.tobytes())
        return f"{h.hexdigest()}|{rng_digest(self.rng)}"

    def ping(self) -> int:
        return os.getpid()


class Probe:
    """One end of a raw Ray transfer: `put` on the writer's node, `fetch` on a holder's (which
    keeps the bytes in its heap, as a holder does), `pull` back from there (as a load does)."""

    def __init__(self) -> None:
        self.refs: list[Any] = []
        self.data: bytes | None = None

    def put(self, nbytes: int) -> tuple[list[Any], float]:
        """`nbytes` of non-zero bytes into this node's object store; (reference, seconds)."""
        data = np.full(nbytes, 0x5A, dtype=np.uint8).tobytes()  # every page touched
        t0 = time.perf_counter()
        self.refs = [ray.put(data)]
        return self.refs, time.perf_counter() - t0

    def fetch(self, refs: list[Any]) -> dict[str, float]:
        """Pull the object to this node (Ray moves it node to node), then CRC32C it."""
        t0 = time.perf_counter()
        self.data = ray.get(refs[0])
        t1 = time.perf_counter()
        crc32c.crc32c(self.data)
        return {"get_s": t1 - t0, "crc_s": time.perf_counter() - t1}

    def give(self) -> np.ndarray | None:
        """As a holder answers a read: a numpy view, which Ray sends out of band."""
        return None if self.data is None else np.frombuffer(self.data, dtype=np.uint8)

    def pull(self, holder: Any) -> float:
        """Seconds to get `holder`'s heap copy into this process (a call's return value: the
        holder's store, then node to node)."""
        t0 = time.perf_counter()
        data = ray.get(holder.give.remote())
        seconds = time.perf_counter() - t0
        del data
        return seconds

    def release(self) -> None:
        self.refs, self.data = [], None
        gc.collect()
