"""Turn the raw results into docs/benchmarks.md, docs/benchmarks.json and docs/img/*.png.

One module per section of the page: `baselines` (disk and single-process baselines at each
state size), `targets`, `trainer` (trainer save vs TorchTitan), `full_save`, `async_save`,
`load`, `scaling` (actor scaling), `gpu`, `storage` (S3 and local DCP I/O), `plots`; `page`
puts them in order and `common` holds what they share (statistics, markdown helpers).

`write` renders everything from a results dict; `merge_storage` adds the storage part to an
existing report without re-rendering (or re-running) the rest.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .baselines import STATE_METRICS, STATE_RATIOS, STATE_SECONDS, state_summary
from .common import TARGETS, fmt, mbps, med, rounded, series
from .page import analysis, markdown
from .phases import phases_summary
from .plots import plots, storage_plot
from .scaling import actor_summaries, actor_summary
from .storage import TITLE, plot_rows, storage_section, storage_summary
from .targets import evaluate

__all__ = [
    "STATE_METRICS",
    "STATE_RATIOS",
    "STATE_SECONDS",
    "TARGETS",
    "actor_summaries",
    "actor_summary",
    "analysis",
    "evaluate",
    "fmt",
    "markdown",
    "mbps",
    "med",
    "merge_storage",
    "phases_summary",
    "plots",
    "series",
    "splice_section",
    "state_summary",
    "write",
]


def _with_storage_summary(results: dict[str, Any], img_dir: str) -> dict[str, Any]:
    """The storage part with its summary added, after drawing its plot (unchanged if absent)."""
    storage = results.get("storage")
    if not storage:
        return results
    storage_plot(plot_rows(storage), img_dir)
    return dict(results, storage=dict(storage, summary=storage_summary(storage)))


def _dump(results: dict[str, Any], out: str) -> None:
    with open(os.path.join(out, "benchmarks.json"), "w") as f:
        json.dump(rounded(results), f, separators=(",", ":"), default=str)
        f.write("\n")


def write(results: dict[str, Any], out: str) -> None:
    """Write benchmarks.json, img/*.png and benchmarks.md into `out`."""
    os.makedirs(out, exist_ok=True)
    images = plots(results, os.path.join(out, "img"))
    targets = evaluate(results)
    results = _with_storage_summary(dict(results), os.path.join(out, "img"))
    results["targets"] = {
        k: {kk: vv for kk, vv in v.items() if kk != "values"} | {"values": v["values"]}
        for k, v in targets.items()
    }
    results["summary"] = {
        "state": [state_summary(p) for p in results.get("state", [])],
        "actors": [
            {k: v for k, v in s.items() if k != "_rows"}
            for s in actor_summaries(results.get("actors", []))
        ],
    }
    _dump(results, out)
    with open(os.path.join(out, "benchmarks.md"), "w") as f:
        f.write(markdown(results, images, out))


def splice_section(page: str, section: str) -> str:
    """`page` with the storage section replaced, or inserted where a full render puts it
    (before 'Where the time goes', else before 'Plots', else at the end)."""
    start = page.find(TITLE + "\n")
    if start >= 0:
        end = page.find("\n## ", start + len(TITLE))
        end = len(page) if end < 0 else end + 1
        return page[:start] + section + "\n" + page[end:]
    for heading in ("## Where the time goes\n", "## Plots\n"):
        at = page.find("\n" + heading)
        if at >= 0:
            return page[: at + 1] + section + "\n" + page[at + 1 :]
    return page.rstrip("\n") + "\n\n" + section


def merge_storage(storage: dict[str, Any], out: str) -> None:
    """Put the storage part into `out`'s benchmarks.json (other keys kept as they are) and its
    section into benchmarks.md (the rest of the page kept byte for byte)."""
    os.makedirs(out, exist_ok=True)
    json_path, md_path = os.path.join(out, "benchmarks.json"), os.path.join(out, "benchmarks.md")
    results: dict[str, Any] = {}
    if os.path.exists(json_path):
        with open(json_path) as f:
            results = json.load(f)
    results["storage"] = storage
    results = _with_storage_summary(results, os.path.join(out, "img"))
    _dump(results, out)
    page = "# forge_ckpt benchmarks\n"
    if os.path.exists(md_path):
        with open(md_path) as f:
            page = f.read()
    with open(md_path, "w") as f:
        f.write(splice_section(page, storage_section(storage)))
