"""`immutable(x)`: a state_dict() marks what never changes in place, so a snapshot that must
not see later mutation (async and deferred saves) references it instead of copying it."""

from __future__ import annotations

from typing import Any


class Immutable:
    """Marks a part of a state whose arrays, tensors and bytes are never changed in place
    once the actor has written them (replay-buffer entries): a background snapshot
    references them instead of copying, so it copies only what can still change. The
    containers inside are still walked at snapshot time (entries added or dropped later are
    not seen). Saved and loaded exactly as the value it wraps."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def immutable(value: Any) -> Immutable:
    """`{"entries": immutable(self.entries)}` in a `state_dict()`: see `Immutable`."""
    return Immutable(value)
