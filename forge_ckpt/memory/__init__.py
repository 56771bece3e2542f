"""The replicated in-memory tier: checkpoint files kept by holder actors on other nodes
(`mem://<run_id>`), persisted to the durable folder every `durable_every` saves."""

from __future__ import annotations

from .holder import MemoryBudgetError
from .tier import MemoryTier, run_id_of

__all__ = ["MemoryBudgetError", "MemoryTier", "run_id_of"]
