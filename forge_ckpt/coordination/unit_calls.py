"""Calls on many units at once (Ray actors, trainer ranks): the fan-out of a phase as one
error naming every unit that failed, the poll until every unit's files are durable, and the
stop of a failed save's units.

Trainer ranks' calls are collectives: they always run at once, never in sequence.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from ..config import CheckpointConfig
from ..storage import FileRecord
from .components import Unit
from .remote_errors import gather_units, save_error
from .results import SaveResult

log = logging.getLogger("forge_ckpt")

Newest = Callable[[], "int | None | OSError"]  # the newest committed step, for error messages


async def run_all(
    units: list[Unit],
    calls: Sequence[Awaitable],
    step: int,
    phase: str,
    config: CheckpointConfig,
    newest: Newest,
    left_s: float | None = None,
) -> list:
    """Await one call per unit, bounded by the phase's timeout setting (or the `left_s` of
    it that a longer wait has left); any failure becomes one error naming every failed unit
    (and the setting, for a timeout)."""
    knob = "load_timeout_s" if phase == "load" else "save_timeout_s"
    limit = getattr(config, knob) if left_s is None else max(left_s, 0.0)
    labels = [u.label for u in units]
    return await gather_units(labels, calls, (limit, knob), phase, step, newest)


async def poll_written(
    units: list[Unit], result: SaveResult, start: float, config: CheckpointConfig, newest: Newest
) -> dict[tuple[str, int], list[FileRecord]]:
    """Poll every unit until its files are durable; a unit never blocks its actor meanwhile.
    Each unit's time to durable goes into `result.seconds`."""
    records: dict[tuple[str, int], list[FileRecord]] = {}
    delay = 0.002
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.save_timeout_s
    while len(records) < len(units):
        waiting = [u for u in units if (u.name, u.index) not in records]
        calls = [u.status() for u in waiting]
        left = deadline - loop.time()  # one bound for the whole wait, not one per round
        done = await run_all(waiting, calls, result.step, "write", config, newest, left)
        for u, recs in zip(waiting, done, strict=True):
            if recs is not None:
                records[(u.name, u.index)] = recs
                result.seconds[u.name] = time.perf_counter() - start
        if loop.time() > deadline:
            late = [u.label for u in units if (u.name, u.index) not in records]
            limit = f"{config.save_timeout_s:.0f}s (CheckpointConfig.save_timeout_s)"
            lines = [f"{x}: still writing after {limit}" for x in late]
            raise save_error(newest(), result.step, lines)
        if len(records) < len(units):
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
    return records


async def stop(units: list[Unit], error: BaseException, timeout: float) -> None:
    """Stop every unit's part of a failed save (a trainer rank joins its background write,
    so the next save and load find it idle). Units that failed or hung are not asked: a hung
    actor would answer only after its hang."""
    failed: set[str] = getattr(error, "failed_units", set())
    units = [u for u in units if u.label not in failed]

    async def abort(u: Unit) -> None:  # the unit's call is made only once this runs
        await asyncio.wait_for(u.abort_save(timeout), timeout + 5)

    results = await asyncio.gather(*(abort(u) for u in units), return_exceptions=True)
    for u, r in zip(units, results, strict=True):
        if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
            log.debug("abort of %s: %s", u.label, r)
