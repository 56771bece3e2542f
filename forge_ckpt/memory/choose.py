"""Which step `load()` tries first across the two tiers (no Ray needed to decide it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TIER = {True: "memory", False: "durable"}


def candidates(
    mem: list[int], marked: list[int], step: int | None, fallback: bool
) -> list[tuple[bool, int]]:
    """(in memory, step), best first: newest first, memory before durable for one step. A
    memory step that is not whole always falls back; a durable one only with `fallback`."""
    if step is not None:
        return [(m, step) for m, steps in ((True, mem), (False, marked)) if step in steps]
    durable = [(False, s) for s in marked[::-1]]
    if not fallback:
        durable = durable[:1]
    return sorted([(True, s) for s in mem] + durable, key=lambda c: (c[1], c[0]), reverse=True)


def abandoned(mem: Mapping[int, Any], durable: Mapping[int, Any]) -> tuple[set[int], set[int]]:
    """(memory steps, durable steps) that a committed step of either tier abandoned, by
    (step, created) identity from the manifests given. A rollback's first save goes to
    memory: until it is persisted, its manifest is the only record that the newer durable
    steps are of the abandoned branch."""
    pairs = {tuple(p) for m in [*mem.values(), *durable.values()] for p in m.supersedes}
    return (
        {s for s, m in mem.items() if (s, m.created) in pairs},
        {s for s, m in durable.items() if (s, m.created) in pairs},
    )
