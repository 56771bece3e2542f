"""Where a committed step keeps an actor replica's file: its name carries the save attempt
that wrote it (`layout.actor_file`), so tests read it from the step's manifest."""

from __future__ import annotations

from typing import Any

from forge_ckpt.steps import layout


def actor_path(folder: Any, step: int, name: str, replica: int = 0) -> str:
    """The step-relative path of replica `replica` of actor `name` in committed step `step`."""
    manifest = layout.read_committed(folder, step)
    return layout.replica_files(manifest.components[name], name)[replica].path
