"""Progress while the job runs (a rich bar on a terminal, a line every 10 steps otherwise) and
the summary printed at the end."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from .metrics import split

PLAIN_EVERY = 10


class Progress:
    def __init__(self, start: int, steps: int, resumed: bool, ready_s: float) -> None:
        self.start, self.steps = start, steps
        self.tty = sys.stdout.isatty()
        self._bar: RichProgress | None = None
        self._marks: list[float] = []  # when each step's line was ready
        where = f"resumed at step {start}" if resumed else "fresh start"
        todo = f"training to step {steps}" if start < steps else f"steps={steps}: nothing to train"
        print(f"GRPO: {where} (actors ready in {ready_s:.1f}s), {todo}", flush=True)

    def __enter__(self) -> Progress:
        if self.tty:
            self._bar = RichProgress(
                TextColumn("[bold]GRPO"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
            )
            self._bar.start()
            self._task = self._bar.add_task("", total=self.steps, completed=self.start)
        return self

    def update(self, record: dict[str, Any]) -> None:
        self._marks.append(time.perf_counter())
        text = (
            f"reward {record['reward_mean']:.3f}  exact {record['exact_frac']:.2f}  "
            f"loss {record['loss']:+.4f}"
        )
        if self._bar is not None:
            self._bar.update(self._task, completed=record["step"], description=text)
        elif record["step"] % PLAIN_EVERY == 0 or record["step"] == self.steps:
            print(f"step {record['step']:5d}/{self.steps}  {text}", flush=True)

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()
        marks = self._marks  # a gap: one step plus the save before it
        gaps = [b - a for a, b in zip(marks, marks[1:], strict=False)]
        if gaps:  # read by benchmarks/grpo/overhead.py
            print(f"step time: median {statistics.median(gaps) * 1e3:.1f} ms over "
                  f"{len(gaps)} steps", flush=True)  # fmt: skip


def summary(
    records: list[dict[str, Any]],
    run_dir: str,
    window: int = 10,
) -> str:
    """Mean reward of the first and last `window` steps, from the whole metrics file, and the
    recoveries from lost actors or nodes (its event lines), so that none goes unnoticed."""
    records, events = split(records)
    if not records:
        return f"no steps recorded in {run_dir}"
    recoveries = [e for e in events if e.get("event") == "recovery"]
    rec = f"\n  recoveries: {len(recoveries)}"
    if recoveries:
        told = [
            f"lost {', '.join(e['lost'])} at step {e['failed_step']}, resumed from "
            f"{e['resumed_step']} in {e['recovery_s']:.1f}s"
            for e in recoveries
        ]
        rec += f" ({'; '.join(told)}; see the event lines of metrics.jsonl)"
    first, last = records[:window], records[-window:]

    def mean(rs: list[dict], key: str) -> float:
        return sum(r[key] for r in rs) / len(rs)

    return (
        f"done: {len(records)} steps in {run_dir}\n"
        f"  mean reward  steps 1-{len(first)}: {mean(first, 'reward_mean'):.3f}   "
        f"last {len(last)}: {mean(last, 'reward_mean'):.3f}\n"
        f"  exact answers steps 1-{len(first)}: {mean(first, 'exact_frac'):.2f}   "
        f"last {len(last)}: {mean(last, 'exact_frac'):.2f}" + rec
    )
