"""Plot a run's reward curve and, from events.jsonl, each checkpoint save's time and size:
`python -m apps.grpo.plot RUN_DIR [OUT.png]`."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run_dir = argv[0]
    out = argv[1] if len(argv) > 1 else os.path.join(run_dir, "reward.png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "event" not in r]
    steps = [r["step"] for r in records]
    window = 10

    def smooth(key: str) -> list[float]:
        vals = [r[key] for r in records]
        return [
            sum(vals[max(0, i - window + 1) : i + 1]) / len(vals[max(0, i - window + 1) : i + 1])
            for i in range(len(vals))
        ]

    saves = _saves(run_dir)
    fig, axes = plt.subplots(2 if saves else 1, 1, figsize=(7, 6 if saves else 3.5), dpi=120,
                             squeeze=False)  # fmt: skip
    ax = axes[0][0]
    ax.plot(steps, [r["reward_mean"] for r in records], color="tab:blue", alpha=0.25, lw=0.8)
    ax.plot(
        steps, smooth("reward_mean"), color="tab:blue", label=f"mean reward ({window}-step mean)"
    )
    ax.plot(steps, smooth("exact_frac"), color="tab:green", label="exact answers")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("GRPO on letter sorting (configs/grpo.yaml, 2-core CPU)")
    if saves:
        _plot_saves(axes[1][0], saves)
    fig.tight_layout()
    fig.savefig(out)
    print(out)
    return 0


def _saves(run_dir: str) -> list[dict[str, Any]]:
    """The committed saves of events.jsonl (a resumed run's redone steps: the last one)."""
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        events = [e for e in map(json.loads, f) if e["kind"] == "save"]
    last = {e["step"]: e for e in events if e["outcome"] == "committed"}
    return [last[s] for s in sorted(last)]


def _plot_saves(ax: Any, saves: list[dict[str, Any]]) -> None:
    """Seconds until committed and seconds the loop was blocked; megabytes on the right."""
    steps = [e["step"] for e in saves]
    ax.plot(steps, [e["seconds"] for e in saves], "o-", color="tab:red", label="save (s)")
    ax.plot(steps, [e["blocked_s"] for e in saves], "o-", color="tab:orange", label="blocked (s)")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    mb = ax.twinx()
    mb.bar(steps, [e["nbytes"] / 1e6 for e in saves], color="tab:gray", alpha=0.3, width=0.6)
    mb.set_ylabel("MB saved")
    ax.set_zorder(mb.get_zorder() + 1)
    ax.patch.set_visible(False)


if __name__ == "__main__":
    sys.exit(main())
