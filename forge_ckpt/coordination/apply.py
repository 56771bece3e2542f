"""A load's apply phase: every unit applies what it prepared, all at once (a trainer's ranks
load in collectives), and a failure becomes one error naming the components applied, those not
applied and those whose outcome is unknown: after the first apply nothing can be undone, so the
error must say exactly what state the job is in."""

from __future__ import annotations

import asyncio
import logging

from ..errors import CheckpointError
from .components import Unit
from .remote_errors import describe, full_text, is_lost, unwrap

log = logging.getLogger("forge_ckpt")


async def apply_all(units: list[Unit], step: int, timeout_s: float) -> None:
    """Apply what every unit prepared, all at once (trainer ranks' loads are collectives).

    Prepare refused every mismatch it could see, so a failure here is a component's own
    `load_state_dict` raising, a lost actor, a file replaced since it was verified, or a
    timeout; other components may already be applied. The CheckpointError names the
    components applied, those not applied and those whose outcome is unknown (also as its
    `applied`, `not_applied`, `unknown` lists), so nobody trains on a mixed state believing
    nothing changed."""
    tasks = [asyncio.ensure_future(u.apply()) for u in units]
    pending: set[asyncio.Future] = set()
    try:
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    except asyncio.CancelledError:  # the actors' calls go on: say what that leaves
        applied = sorted({u.name for u, t in zip(units, tasks, strict=True) if t.done()})
        log.error("load of step %d was cancelled while applying: the job's state may be mixed "
                  "(applied so far: %s; the others may still apply). Do not train on it: load "
                  "again", step, applied or "none")  # fmt: skip
        raise
    for t in pending:
        t.cancel()
    failures: dict[str, BaseException] = {}
    late: set[str] = set()
    for u, t in zip(units, tasks, strict=True):
        if t in pending or t.cancelled():
            late.add(u.label)
            failures[u.label] = TimeoutError(
                f"no answer within {timeout_s:.0f}s (CheckpointConfig.load_timeout_s)"
            )
        elif t.exception() is not None:
            failures[u.label] = t.exception()  # type: ignore[assignment]
    if failures:
        raise apply_error(units, failures, late, step)


def apply_error(
    units: list[Unit], failures: dict[str, BaseException], late: set[str], step: int
) -> CheckpointError:
    """One error for a failed apply phase: which components were applied and which not."""
    verdict: dict[str, list[str]] = {"applied": [], "not applied": [], "unknown": []}
    for name in dict.fromkeys(u.name for u in units):
        mine = [u for u in units if u.name == name]
        bad = [u for u in mine if u.label in failures]
        if not bad:
            verdict["applied"].append(name)
        elif any(u.label in late for u in bad):  # a late replica may apply still
            verdict["unknown"].append(name)
        else:
            good = [u.index for u in mine if u not in bad]
            verdict["not applied"].append(f"{name} (only {good} applied)" if good else name)
    for label, e in failures.items():
        log.error("%s failed while applying step %d:\n%s", label, step, full_text(e))
    lines = [f"{label}: {describe(unwrap(e))}" for label, e in failures.items()]
    summary = "".join(f"\n  {k}: {', '.join(v)}" for k, v in verdict.items() if v)
    err = CheckpointError(
        f"load of step {step} failed while applying, after every component had prepared; "
        f"the job's state is now mixed:{summary}\n  "
        + "\n  ".join(lines)
        + "\nA component that failed may be partly changed. Do not train on: fix or restart "
        "the failing component, then load again (a load that succeeds applies every component)."
    )
    err.applied, err.not_applied = verdict["applied"], verdict["not applied"]  # type: ignore[attr-defined]
    err.unknown = verdict["unknown"]  # type: ignore[attr-defined]
    err.details = {label: full_text(e) for label, e in failures.items()}  # type: ignore[attr-defined]
    err.lost = [label for label, e in failures.items() if is_lost(e)]  # type: ignore[attr-defined]
    err.failed_units = set(failures)  # type: ignore[attr-defined]
    err.__cause__ = next(iter(failures.values()))
    return err
