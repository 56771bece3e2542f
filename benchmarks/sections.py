"""The benchmarks that run on their own (`python -m benchmarks.<name>`) each own one section of
docs/benchmarks.md, between marker comments, so each rewrites its part and leaves the rest."""

from __future__ import annotations

import json
import os
from typing import Any


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_section(name: str, block: str, results: dict[str, Any], docs: str = "docs") -> None:
    """`results` to `docs`/benchmarks_<name>.json; `block` (which starts and ends with the
    markers) replaces the section in `docs`/benchmarks.md, or is appended."""
    with open(os.path.join(docs, f"benchmarks_{name}.json"), "w") as f:
        json.dump(results, f, indent=1)
    begin, end = markers(name)
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
