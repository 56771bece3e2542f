"""Plot a run's reward curve: `python -m apps.grpo.plot RUN_DIR [OUT.png]`."""

from __future__ import annotations

import json
import os
import sys


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

    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=120)
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
    fig.tight_layout()
    fig.savefig(out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
