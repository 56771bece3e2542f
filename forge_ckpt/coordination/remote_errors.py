"""Turning failures of many units (Ray actors, trainer ranks) into one readable error.

The message has one line per failed unit, what to do, and which step is still the newest;
the full remote tracebacks are logged and kept on the error (`__cause__` is the first unit's
exception, `details` maps each unit to its whole traceback text), so nothing is lost. A unit
whose actor, worker or node is gone reads as such ("lost (its node died: ...)"), and the error's
`lost` lists those units: a supervisor (apps/grpo/supervisor.py) recreates them and resumes.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ..errors import CheckpointError, CheckpointSaveError

log = logging.getLogger("forge_ckpt")


def unwrap(e: BaseException) -> BaseException:
    """The user's exception inside a Ray task error, when Ray kept it."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


def describe(e: BaseException) -> str:
    """One line: what happened to the unit (a lost actor or node in plain words), else the
    exception type and the last line of its message."""
    import ray.exceptions as rex

    if isinstance(e, rex.ActorUnavailableError):
        return (
            "unreachable (ActorUnavailableError: its node may be overloaded or restarting); "
            "the call may or may not have run"
        )
    if isinstance(e, rex.RayActorError):
        return _actor_death(e)
    if isinstance(e, (rex.NodeDiedError, rex.LocalRayletDiedError)):
        return f"lost (its node died: {_reason(str(e))})"
    if isinstance(e, rex.ObjectLostError):
        return f"lost (an object it needed was lost: {type(e).__name__}, its owner or node died)"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


_FIELDS = ("class_name:", "actor_id:", "pid:", "name:", "namespace:", "ip:")


def _reason(text: str) -> str:
    """Ray's death text without its header and its `key: value` fields, on one line."""
    lines = [ln.strip() for ln in text.strip().splitlines()]
    kept = [
        ln
        for ln in lines[1:] or lines
        if ln and not ln.startswith(_FIELDS) and "died unexpectedly before finishing" not in ln
    ]
    return "; ".join(kept) or "no reason given by Ray"


def _actor_death(e: BaseException) -> str:
    """A RayActorError as one line: node loss, a crash in `__init__`, or the actor's death."""
    text = str(e)
    if getattr(e, "actor_init_failed", False):
        last = text.strip().splitlines()[-1] if text.strip() else ""
        return f"the actor died in its constructor ({last}); fix it and register it again"
    reason = _reason(text)
    if "node has died" in text or getattr(e, "preempted", False):
        reason = reason.replace("The actor died because its node has died. ", "")
        return (
            f"lost (its node died: {reason}); recreate the actor on a live node and "
            "register it again (replace=True)"
        )
    return f"the actor died ({reason}); restart it and register it again (replace=True)"


def is_lost(e: BaseException) -> bool:
    """True when a unit failed because its actor, worker or node is gone (not a bug in it):
    the job can recreate the actor and carry on from the newest committed step."""
    import ray.exceptions as rex

    lost: tuple[type[BaseException], ...] = (
        rex.RayActorError,
        rex.NodeDiedError,
        rex.LocalRayletDiedError,
        rex.ObjectLostError,
        rex.WorkerCrashedError,
    )
    return isinstance(unwrap(e), lost) or isinstance(e, lost)


def full_text(e: BaseException) -> str:
    """The whole story of a failure: Ray's error text holds the remote traceback."""
    if type(e).__module__.startswith("ray"):
        return str(e)
    return "".join(traceback.format_exception(e)).rstrip()


def save_error(newest: int | None | OSError, step: int, lines: list[str]) -> CheckpointSaveError:
    if isinstance(newest, OSError):
        prev = "the committed steps could not be listed now, and none of them was touched"
    elif newest is None:
        prev = "there is no committed step yet"
    else:
        prev = f"step {newest} is still the newest committed step"
    return CheckpointSaveError(
        f"save of step {step} aborted, nothing was committed ({prev}):\n  "
        + "\n  ".join(lines)
        + "\nFix or restart the failing component(s) and save again."
    )


def failure_error(
    newest: int | None | OSError, step: int, phase: str, failures: list[tuple[str, BaseException]]
) -> Exception:
    details = {label: full_text(e) for label, e in failures}
    for label, text in details.items():
        log.error("%s failed during %s of step %d:\n%s", label, phase, step, text)
    causes = [(label, unwrap(e)) for label, e in failures]
    lost = [label for label, e in failures if is_lost(e)]
    if phase == "load":
        # forge_ckpt's own errors (corrupt file, mismatch) are raised as they are.
        own = next((c for _, c in causes if isinstance(c, CheckpointError)), None)
        if own is not None:
            own.details = details  # type: ignore[attr-defined]
            own.lost = lost  # type: ignore[attr-defined]
            return own
        lines = [f"{label}: {describe(c)}" for label, c in causes]
        err: Exception = CheckpointError(
            f"load of step {step} failed, nothing was applied:\n  " + "\n  ".join(lines)
        )
    else:
        err = save_error(newest, step, [f"{label}: {describe(c)}" for label, c in causes])
    err.details = details  # type: ignore[attr-defined]
    err.lost = lost  # type: ignore[attr-defined]  # the units whose actor or node is gone
    err.__cause__ = failures[0][1]
    return err


async def gather_units(
    labels: list[str],
    calls: Sequence[Awaitable],
    limit: tuple[float, str],
    phase: str,
    step: int,
    newest: Callable[[], Any],
) -> list:
    """Await one call per unit at once, each within `limit` (seconds, and the config knob a
    timeout names); any failure becomes one error naming every failed unit, with
    `failed_units` (their labels) for the abort, which must not wait on them."""
    timeout, knob = limit
    tasks = [asyncio.ensure_future(a) for a in calls]
    done, pending = await asyncio.wait(tasks, timeout=timeout) if tasks else (set(), set())
    for t in pending:
        t.cancel()
    failures: list[tuple[str, BaseException]] = []
    for label, t in zip(labels, tasks, strict=True):
        if t in pending:
            late = f"no answer within {timeout:.0f}s (CheckpointConfig.{knob})"
            failures.append((label, TimeoutError(late)))
        elif t.exception() is not None:
            failures.append((label, t.exception()))  # type: ignore[arg-type]
    if failures:
        err = failure_error(newest(), step, phase, failures)
        err.failed_units = {label for label, _ in failures}  # type: ignore[attr-defined]
        raise err
    return [t.result() for t in tasks]
