"""The replicated in-memory tier: checkpoint files kept by holder actors on other nodes
(`mem://<run_id>`), persisted to the durable folder every `durable_every` saves."""

from __future__ import annotations

from .holder import MemoryBudgetError
from .holders import release_holders
from .tier import MemoryTier, run_id_of

__all__ = ["MemoryBudgetError", "MemoryTier", "release_holders", "run_id_of"]
