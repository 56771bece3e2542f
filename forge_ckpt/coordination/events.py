"""One structured record per save, persist and load, for the user's dashboards.

Every save (`CheckpointCoordinator.save`, whatever its mode; in async modes when its
background part ends), every persist of a memory step to the durable folder, and every load
emits one `CheckpointEvent`: through the Python logger `forge_ckpt.coordination.events` (INFO; the
message is the record as one JSON object, also in the log record's `event` attribute) and to
`CheckpointConfig.on_event`, a callable given in code (never from YAML). A callback that
raises is logged and ignored: dashboards never fail a save.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

log = logging.getLogger("forge_ckpt.coordination.events")

Kind = Literal["save", "persist", "load"]
# committed: the step is committed (save, persist); loaded; failed (`error` says why);
# skipped: nothing to do (the step was already committed; a load of an empty folder);
# cancelled: close() dropped a background save or persist before its commit.
Outcome = Literal["committed", "loaded", "failed", "skipped", "cancelled"]


@dataclass
class CheckpointEvent:
    kind: Kind
    step: int | None  # None: a load that found no committed step
    tier: str  # "durable" or "memory": where the step was written or read
    outcome: Outcome
    nbytes: int = 0  # bytes of the step's files (0 when nothing was written or read)
    seconds: float = 0.0  # from the call until the commit (load: until applied) or failure
    blocked_s: float = 0.0  # how long the caller was held (async saves: the snapshot)
    components: dict[str, float] = field(default_factory=dict)  # per component: until durable
    error: str | None = None  # `type: message` of the failure
    time: float = 0.0  # wall clock (time.time()) when the event was emitted

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Events:
    """Emits events to the logger and the configured callback."""

    def __init__(self, callback: Callable[[CheckpointEvent], Any] | None = None) -> None:
        self.callback = callback

    def emit(self, event: CheckpointEvent) -> None:
        event.time = time.time()
        if log.isEnabledFor(logging.INFO):  # (the JSON is work even when nobody reads it)
            record = event.to_dict()
            log.info("%s", json.dumps(record), extra={"event": record})
        if self.callback is None:
            return
        try:
            self.callback(event)
        except Exception:  # a broken dashboard must not fail the job
            log.exception("CheckpointConfig.on_event raised (ignored)")

    def failed(
        self,
        kind: Kind,
        step: int | None,
        tier: str,
        started: float,
        error: BaseException,
        blocked_s: float | None = None,
    ) -> None:
        """A save, persist or load that raised (`blocked_s`: None, it held its caller
        throughout)."""
        seconds = time.perf_counter() - started
        cancelled = isinstance(error, _cancelled_types())
        self.emit(
            CheckpointEvent(
                kind,
                step,
                tier,
                "cancelled" if cancelled else "failed",
                seconds=seconds,
                blocked_s=seconds if blocked_s is None else blocked_s,
                error=None if cancelled else f"{type(error).__name__}: {error}",
            )
        )

    def saved(self, result: Any, tier: str) -> None:
        """A save that returned committed (a SaveResult; all zero: the step was already)."""
        self.emit(
            CheckpointEvent(
                "save",
                result.step,
                tier,
                "committed" if result.total_s > 0 else "skipped",
                nbytes=result.nbytes,
                seconds=result.total_s,
                blocked_s=result.blocked_s,
                components=dict(result.seconds),
            )
        )

    def background(self, task: Any, result: Any, tier: str, started: float) -> None:
        """The end of an async save's background part (a done callback of its task)."""
        if task.cancelled():
            self.failed("save", result.step, tier, started, _cancelled_types()[0](),
                        result.blocked_s)  # fmt: skip
        elif task.exception() is not None:
            self.failed("save", result.step, tier, started, task.exception(), result.blocked_s)
        else:
            self.saved(task.result(), tier)

    def loaded(self, result: Any, started: float) -> None:
        """A load that returned (a LoadResult, or None: no committed step)."""
        seconds = time.perf_counter() - started
        if result is None:
            self.emit(CheckpointEvent("load", None, "durable", "skipped", seconds=seconds,
                                      blocked_s=seconds))  # fmt: skip
            return
        self.emit(
            CheckpointEvent(
                "load",
                result.step,
                result.tier,
                "loaded",
                nbytes=result.manifest.nbytes,
                seconds=seconds,
                blocked_s=seconds,
            )
        )


def _cancelled_types() -> tuple[type[BaseException], ...]:
    import asyncio
    import concurrent.futures

    return (asyncio.CancelledError, concurrent.futures.CancelledError)
