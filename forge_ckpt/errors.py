"""Errors that say what is wrong and what to do about it.

Every error raised to a user of forge_ckpt derives from `CheckpointError`, so a job can catch
one type. Each message names the component, step or file concerned.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every forge_ckpt error."""


class CheckpointCorruptError(CheckpointError):
    """A file of a committed step is missing, truncated or fails its checksum."""

    def __init__(self, path: str, problem: str, hint: str | None = None) -> None:
        self.path = path
        self.problem = problem
        self.hint = hint
        hint = hint or (
            "run `forge-ckpt verify` on the step folder; load an older step with "
            "`load(step=...)` or pass `fallback=True` to use the newest intact one"
        )
        super().__init__(f"{path}: {problem}. {hint}")

    def __reduce__(self):  # errors cross Ray process boundaries by pickling
        return (type(self), (self.path, self.problem, self.hint))


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not match the job that tries to load it."""

    def __init__(self, differences: list[str], hint: str | None = None) -> None:
        self.differences = list(differences)
        self.hint = hint
        lines = "\n".join(f"  - {d}" for d in self.differences)
        hint = hint or (
            "start a fresh run in another folder, or pass `allow_mismatch=True` to load anyway "
            "where that is possible"
        )
        super().__init__(f"checkpoint does not match this job:\n{lines}\n{hint}")

    def __reduce__(self):
        return (type(self), (self.differences, self.hint))


class CheckpointSignatureError(CheckpointError):
    """A step's signature is missing, wrong, or cannot be checked with the configured keys.

    Not a `CheckpointCorruptError` on purpose: `fallback` never moves a step aside because
    this job holds the wrong key."""


class CheckpointSaveError(CheckpointError):
    """A save was aborted; nothing was committed and the previous step is still the newest."""


class CheckpointLockedError(CheckpointError):
    """Another live process holds the checkpoint folder."""


class CheckpointLeaseCorruptError(CheckpointError):
    """The folder's lease (its writer and its commit record) is damaged.

    Not a `CheckpointCorruptError` on purpose: the lease is the record of which steps are
    committed, so `fallback` must never move a good step aside because of it, and no reader
    may count every `COMMIT` instead (a writer that had lost the lease may have left one)."""

    def __init__(self, path: str, problem: str) -> None:
        self.path, self.problem = path, problem
        super().__init__(
            f"{path}: the folder's lease is damaged ({problem}). It is the folder's commit "
            "record and its fence: no step can be told committed from it, and no job may take "
            "the folder over it. Stop every job that writes this folder, check its steps "
            "(`forge-ckpt list`; a COMMIT of a job that lost the lease would count again), "
            "then delete this file: the next job records every COMMIT present"
        )

    def __reduce__(self):
        return (type(self), (self.path, self.problem))


class NotSerializableError(CheckpointError, TypeError):
    """A value in an actor's state cannot be stored; raised before anything is written."""

    def __init__(self, where: str, problem: str) -> None:
        self.where = where
        self.problem = problem
        super().__init__(f"{where}: {problem}")

    def __reduce__(self):
        return (type(self), (self.where, self.problem))


class InvalidNameError(CheckpointError, ValueError):
    """A component name that could escape the step folder or collide with reserved files."""
