"""Replay-buffer-like actors under test (Checkpointable, numpy columns). Light on purpose:
every actor is its own process, so this module imports forge_ckpt's actor side only."""

from __future__ import annotations

import gc
import os
from typing import Any

import numpy as np

from forge_ckpt import Checkpointable

from .timers import install_timers, rss, take_phases, timed_call

MiB = 1 << 20

ACTOR_ARRAY = 32 * MiB  # a replay buffer as a few large columns


class BenchActor(Checkpointable):
    """A replay-buffer-like actor: float32 columns of `nbytes` in total, plus small metadata and
    its own numpy generator (saved by forge_ckpt's RNG capture)."""

    def __init__(self) -> None:
        install_timers("actor")
        self.columns: list[np.ndarray] = []
        self.rng = np.random.default_rng(0)
        self.meta = {"inserted": 0, "version": 0, "episode_returns": []}

    def rng_generators(self) -> dict[str, Any]:
        return {"rng": self.rng}

    def resize(self, nbytes: int, seed: int = 0) -> int:
        """Hold `nbytes` of columns (touched: every page is really in memory)."""
        self.columns = []
        gc.collect()
        left = nbytes
        while left > 0:
            n = min(left, ACTOR_ARRAY) // 4
            if n == 0:
                break
            col = np.empty(n, dtype=np.float32)
            col[:] = seed + len(self.columns)
            self.columns.append(col)
            left -= n * 4
        self.meta = {
            "inserted": nbytes // 4,
            "version": seed,
            "episode_returns": [float(i) for i in range(100)],
        }
        take_phases()
        return sum(c.nbytes for c in self.columns)

    def state_dict(self) -> dict[str, Any]:
        return {"meta": self.meta, "columns": self.columns}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.meta = state["meta"]
        self.columns = list(state["columns"])

    # The protocol methods, timed (they are what the coordinator calls through Ray).

    def forge_begin_save(
        self, step_dir: str, relpath: str, background: bool, defer: bool = False
    ) -> int:
        return timed_call(
            "begin_save", super().forge_begin_save, step_dir, relpath, background, defer
        )

    def forge_prepare_load(
        self, step_dir: str, records: list[dict], verify: bool, options: dict
    ) -> None:
        timed_call("prepare_load", super().forge_prepare_load, step_dir, records, verify, options)

    def forge_apply_load(self) -> None:
        timed_call("apply_load", super().forge_apply_load)

    def phases(self) -> dict[str, Any]:
        out = take_phases()
        out["rss"] = rss()
        return out

    def ping(self) -> int:
        return os.getpid()
