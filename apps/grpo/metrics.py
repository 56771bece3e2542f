"""metrics.jsonl: one JSON line per trained step, rewritten exactly on resume, and one line per
event that is not a step (a recovery after an actor or node was lost: `{"event": "recovery",
...}`, apps/grpo/supervisor.py).

A crash can leave lines for steps after the newest checkpoint (and half a line). On resume from
step K the file is cut before its first line for a step after K; the resumed run then writes
K+1, ... again, so the step lines of the finished file are byte-for-byte the ones an
uninterrupted run writes (a run without recoveries writes the very same file). Event lines
before the cut stay: a recovery happened even if its steps are computed again. Floats are
written by `json` with `repr` precision, so equal lines mean bit-equal numbers.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any


def step_record(
    step: int, trained: dict[str, Any], rewards: Any, stats: dict[str, Any], rollout: dict
) -> dict[str, Any]:
    """The fields every step line starts with, in this order (sync and async modes): the
    trainer rank 0's results `trained`, the step's `rewards` and the reward actor's `stats`.
    The order is part of the file's bytes: a resumed run must write the same lines."""
    return {
        "step": step,
        "loss": trained["loss"],
        "reward_mean": float(rewards.mean()),
        "exact_frac": float((rewards == 1.0).mean()),
        "reward_running_mean": stats["mean"],
        "policy_version": trained["version"],
        "rollout_version": int(rollout["version"][0]),
        "lr": trained["lr"],
        "grad_norm": trained["grad_norm"],
        "clip_frac": trained["clip_frac"],
        "kl": trained["kl"],
    }


class MetricsLog:
    def __init__(self, path: str) -> None:
        self.path = path
        self.last_step = 0  # the step of the last line appended (or kept on resume)

    def truncate_after(self, step: int) -> int:
        """Keep the leading lines for steps 1..`step`; returns how many were kept."""
        if not os.path.exists(self.path):
            if step > 0:
                print(f"warning: {self.path} is missing; lines for steps <= {step} are lost")
            self.last_step = step
            return 0
        kept, offset = 0, 0
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    break  # a line cut by a crash
                if not line.endswith(b"\n"):
                    break
                if "event" not in record:
                    if record.get("step") != kept + 1 or kept >= step:
                        break
                    kept += 1
                offset += len(line)
        with open(self.path, "r+b") as f:
            f.truncate(offset)
            os.fsync(f.fileno())
        if kept < step:
            print(f"warning: {self.path} holds lines for steps 1..{kept} only (resuming at {step})")
        self.last_step = step
        return kept

    def append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.last_step = int(record["step"])

    def append_event(self, event: dict[str, Any]) -> None:
        """A line that is not a step (rare: written and fsynced at once)."""
        with open(self.path, "a") as f:
            f.write(json.dumps(event, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def sync(self) -> None:
        """Make the lines so far durable (before a checkpoint that counts them is committed)."""
        if os.path.exists(self.path):
            with open(self.path, "rb") as f:
                os.fsync(f.fileno())

    def read(self) -> list[dict[str, Any]]:
        """Every line: step records and events (`split` tells them apart)."""
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]


def split(records: list[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    """(step records, event records) of a metrics file."""
    events = [r for r in records if "event" in r]
    return [r for r in records if "event" not in r], events


class EventsLog:
    """events.jsonl: forge_ckpt's checkpoint events (one line per save, persist and load, as
    `CheckpointEvent.to_dict()`), appended as they come, never cut on resume (a save that a
    crash made redo happened all the same). Kept apart from metrics.jsonl, whose step lines
    must be byte-equal between a killed and an uninterrupted run: timings never are."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._mutex = threading.Lock()  # a persist's event may come from another task

    def __call__(self, event: Any) -> None:
        line = json.dumps(event.to_dict(), sort_keys=True) + "\n"
        with self._mutex, open(self.path, "a") as f:
            f.write(line)

    def read(self) -> list[dict[str, Any]]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]
