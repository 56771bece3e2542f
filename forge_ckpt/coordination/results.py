"""What `CheckpointCoordinator.save` and `load` return."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..steps import layout


@dataclass
class SaveResult:
    """What one save wrote. In async mode `save()` returns it with `committed=False`;
    `wait()` returns the completed one."""

    step: int
    path: str
    nbytes: int = 0
    blocked_s: float = 0.0  # how long save() held the caller (the snapshot)
    total_s: float = 0.0  # until the commit marker was durable
    seconds: dict[str, float] = field(default_factory=dict)  # per component, until durable
    committed: bool = False


@dataclass
class LoadResult:
    step: int
    extra: Any
    path: str
    manifest: layout.Manifest
    tier: str = "durable"  # or "memory"
