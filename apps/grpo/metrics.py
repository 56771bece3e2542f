"""metrics.jsonl: one JSON line per trained step, rewritten exactly on resume.

A crash can leave lines for steps after the newest checkpoint (and half a line). On resume from
step K the file is cut to its lines for steps <= K; the resumed run then writes K+1, ... again,
so the finished file is byte-for-byte the one an uninterrupted run writes. Floats are written by
`json` with `repr` precision, so equal files mean bit-equal numbers.
"""

from __future__ import annotations

import json
import os
from typing import Any


class MetricsLog:
    def __init__(self, path: str) -> None:
        self.path = path

    def truncate_after(self, step: int) -> int:
        """Keep the leading lines for steps 1..`step`; returns how many were kept."""
        if not os.path.exists(self.path):
            if step > 0:
                print(f"warning: {self.path} is missing; lines for steps <= {step} are lost")
            return 0
        kept, offset = 0, 0
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    break  # a line cut by a crash
                if not line.endswith(b"\n") or record.get("step") != kept + 1 or kept >= step:
                    break
                kept += 1
                offset += len(line)
        with open(self.path, "r+b") as f:
            f.truncate(offset)
            os.fsync(f.fileno())
        if kept < step:
            print(f"warning: {self.path} holds lines for steps 1..{kept} only (resuming at {step})")
        return kept

    def append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def sync(self) -> None:
        """Make the lines so far durable (before a checkpoint that counts them is committed)."""
        if os.path.exists(self.path):
            with open(self.path, "rb") as f:
                os.fsync(f.fileno())

    def read(self) -> list[dict[str, Any]]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]
