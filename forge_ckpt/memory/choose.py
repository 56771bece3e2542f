"""Which step `load()` tries first across the two tiers (no Ray needed to decide it)."""

from __future__ import annotations

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
