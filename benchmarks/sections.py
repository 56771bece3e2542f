"""The benchmarks that run on their own (`python -m benchmarks.<name>`) each own one section of
docs/benchmarks.md, between marker comments, so each rewrites its part and leaves the rest."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from . import contention


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_section(name: str, block: str, results: dict[str, Any], docs: str = "docs") -> None:
    """`results` to `docs`/benchmarks_<name>.json; `block` (which starts and ends with the
    markers) replaces the section in `docs`/benchmarks.md, or is appended. The run's load
    record (`results["load"]`, benchmarks.contention) is stated at the section's end."""
    begin, end = markers(name)
    if end in block:
        i = block.rindex(end)
        note = contention.note(results.get("load"))
        block = f"{block[:i].rstrip()}\n\n{note}\n{block[i:]}"
    with open(os.path.join(docs, f"benchmarks_{name}.json"), "w") as f:
        json.dump(results, f, indent=1)
    path = os.path.join(docs, "benchmarks.md")
    text = ""
    if os.path.exists(path):  # a --quick run writes to a fresh folder
        with open(path) as f:
            text = f.read()
    if begin in text:
        text = text[: text.index(begin)] + block.rstrip() + text[text.index(end) + len(end) :]
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + block.rstrip() + "\n"
    with open(path, "w") as f:
        f.write(text)


def stamp(command: str) -> dict[str, Any]:
    """What every results file records about its run: the command, the day, the cores."""
    return {"command": command, "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}


def measure_and_write(
    name: str,
    measure: Callable[[str], dict[str, Any]],
    markdown: Callable[[dict[str, Any]], str],
    write: bool = True,
) -> dict[str, Any]:
    """`measure(scratch)` in a fresh folder under runs/ (removed after, even on error); then
    section `name` is written (unless `write` is false: a quick run) and printed."""
    os.makedirs("runs", exist_ok=True)
    root = tempfile.mkdtemp(prefix=f"{name}-", dir=os.path.abspath("runs"))
    load = contention.now()
    try:
        res = measure(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res["load"] = contention.record(load, _trial_loads(res))
    if write:
        write_section(name, markdown(res), res)
    print(markdown(res))
    return res


def _trial_loads(res: dict[str, Any]) -> list[float]:
    """Load averages a benchmark recorded at its trials' starts (`loadavg` in trial rows)."""
    rows = res.get("trials") if isinstance(res.get("trials"), list) else []
    return [r["loadavg"] for r in rows if isinstance(r, dict) and "loadavg" in r]
