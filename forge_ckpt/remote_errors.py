"""Turning failures of many units (Ray actors, trainer ranks) into one readable error.

The message has one line per failed unit, what to do, and which step is still the newest;
the full remote tracebacks are logged and kept on the error (`__cause__` is the first unit's
exception, `details` maps each unit to its whole traceback text), so nothing is lost.
"""

from __future__ import annotations

import logging
import traceback

from .errors import CheckpointError, CheckpointSaveError

log = logging.getLogger("forge_ckpt")


def unwrap(e: BaseException) -> BaseException:
    """The user's exception inside a Ray task error, when Ray kept it."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


def describe(e: BaseException) -> str:
    """One line: the exception type and the last line of its message."""
    import ray.exceptions as rex

    if isinstance(e, rex.RayActorError):
        return "the actor died (RayActorError); restart it and register it again"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


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
    if phase == "load":
        # forge_ckpt's own errors (corrupt file, mismatch) are raised as they are.
        own = next((c for _, c in causes if isinstance(c, CheckpointError)), None)
        if own is not None:
            own.details = details  # type: ignore[attr-defined]
            return own
        lines = [f"{label}: {describe(c)}" for label, c in causes]
        err: Exception = CheckpointError(
            f"load of step {step} failed, nothing was applied:\n  " + "\n  ".join(lines)
        )
    else:
        err = save_error(newest, step, [f"{label}: {describe(c)}" for label, c in causes])
    err.details = details  # type: ignore[attr-defined]
    err.__cause__ = failures[0][1]
    return err
