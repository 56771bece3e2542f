"""`Checkpointable`: the mixin that lets a Ray actor save and restore its own state.

The actor writes its own file straight into the step folder, so large state (a replay buffer)
never funnels through the driver and all actors write in parallel. The saved state is the
user's `state_dict()` plus every RNG stream of the actor process (`forge_ckpt.actors.rng`).

Save is two-phase so that a save can run in the background: `forge_begin_save` takes the
snapshot (an in-memory copy: the consistent cut) and, in sync mode, also writes it and
returns the file's record; `forge_save_status` reports a background write's file once it is
durable; `forge_abort_save` joins and forgets a write whose step failed elsewhere. The actor
opens the storage itself from the picklable spec it is handed (a local folder or `s3://`).
Load is two-phase too:
`forge_prepare_load` reads, verifies and decodes (and calls `validate_state_dict`), and only
when every component has prepared does `forge_apply_load` change the actor, so a corrupt or
mismatched checkpoint never leaves some actors restored and others not. A state resharded
from another replica count (see reshard.py) arrives already decoded in `options["state"]` and
goes through the same validation and two phases.

The mixin's methods are synchronous on purpose: one `async def` method would turn the whole
actor into an async actor whose calls interleave. Async actors register as plain actors
(their `state_dict`/`load_state_dict` may be `async def`); the coordinator then does the I/O.
"""

from __future__ import annotations

import posixpath
import threading
from typing import TYPE_CHECKING, Any

from .. import serialization
from ..errors import CheckpointError, CheckpointMismatchError
from ..storage import FileRecord, Storage, StorageSpec, open_storage
from . import rng

STATE_FORMAT = 1


def wrap_state(state: Any, rng_state: Any = None) -> dict[str, Any]:
    """The content of an actor file: the user's state and, for Checkpointable actors, RNG."""
    return {"format": STATE_FORMAT, "state": state, "rng": rng_state}


class BackgroundWrite:
    """A snapshot being written by a thread; `status()` polls without blocking the actor."""

    def __init__(
        self, snap: serialization.Snapshot, store: Storage, relpath: str, background: bool
    ):
        self._result: FileRecord | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        args = (snap, store, relpath)
        if background:
            self._thread = threading.Thread(target=self._run, args=args, daemon=True)
            self._thread.start()
        else:
            self._run(*args)
            if self._error is not None:
                raise self._error

    def _run(self, snap: serialization.Snapshot, store: Storage, relpath: str) -> None:
        try:
            self._result = snap.write_to(store, relpath)
            store.sync_dir(posixpath.dirname(relpath))  # the file's name, not only its data
        except BaseException as e:  # reported by status(), never dropped
            self._error = e

    def status(self) -> list[dict] | None:
        if self._thread is not None and self._thread.is_alive():
            return None
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return [self._result.to_dict()]

    def join(self, timeout_s: float) -> bool:
        """Wait for the write to end; True if it did (its outcome no longer matters)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True


class Checkpointable:
    """Mixin for Ray actor classes that define `state_dict()` and `load_state_dict(state)`.

    Optional hooks: `rng_generators()` names the generator objects the actor owns;
    `validate_state_dict(state)` refuses a checkpoint (raise `CheckpointMismatchError`) before
    anything is loaded, or returns lines naming differences it accepts (the driver logs them);
    a static method `reshard_states(states, replicas) -> list` declares how N saved replica
    states become M (not defined here: its absence means "no rule").
    """

    _forge_write: BackgroundWrite | None  # the last save's write; unset before the first save

    if TYPE_CHECKING:  # defined by the actor class that mixes this in

        def state_dict(self) -> Any: ...

        def load_state_dict(self, state: Any) -> None: ...

    def rng_generators(self) -> dict[str, rng.Generator]:
        return {}

    def validate_state_dict(self, state: Any) -> list[str] | None:
        return None

    def forge_begin_save(
        self, where: StorageSpec, relpath: str, background: bool, defer: bool = False
    ) -> dict:
        """Snapshot now; write now (sync) or in a thread (background). Returns the snapshot's
        size and, when the write is already done (sync), the written file's record. `defer`
        changes nothing here: the snapshot is this call, the actor's next call runs after it
        (the parts the state marks `immutable` are not copied, see serialization)."""
        del defer
        pending = getattr(self, "_forge_write", None)
        if pending is not None and not pending.join(0):
            raise RuntimeError(f"{type(self).__name__}: the previous background write still runs")
        state = wrap_state(self.state_dict(), rng.capture(self.rng_generators()))
        name = f"{type(self).__name__}[{relpath}]"
        # copy=False is safe in sync mode: the actor runs nothing else until the write ends.
        snap = serialization.snapshot(state, name=name, copy=background)
        self._forge_write = BackgroundWrite(snap, open_storage(where), relpath, background)
        return {"nbytes": snap.nbytes, "files": None if background else self.forge_save_status()}

    def forge_save_status(self) -> list[dict] | None:
        write = self._forge_write
        assert write is not None, "forge_save_status() before forge_begin_save()"
        return write.status()

    def forge_abort_save(self, timeout_s: float = 60.0) -> bool:
        """The step failed elsewhere: wait (bounded) for a background write and forget it, so
        that the next save starts clean. True if nothing is left running."""
        pending, self._forge_write = getattr(self, "_forge_write", None), None
        return pending is None or pending.join(timeout_s)

    def forge_prepare_load(
        self, where: StorageSpec, records: list[dict], verify: bool, options: dict
    ) -> list[str]:
        """Stage the state without applying it; returns the differences the actor accepts.
        Everything `forge_apply_load` could refuse (the RNG streams' names and kinds, the
        actor's own `validate_state_dict`) is checked here, before any component changes."""
        if "state" in options:  # resharded by the driver from the saved replicas' files
            data, source = options["state"], f"{type(self).__name__} (resharded state)"
        else:
            (record,) = (FileRecord.from_dict(r) for r in records)
            store = open_storage(where)
            data = serialization.load_from(store, record.path, record if verify else None)
            source = store.where(record.path)
        if data.get("rng") is not None:
            problems = rng.differences(data["rng"], self.rng_generators())
            if problems:
                raise CheckpointMismatchError([f"{source}: {p}" for p in problems])
        notes = self.validate_state_dict(data["state"])
        self._forge_staged = data
        return list(notes or [])

    def forge_apply_load(self) -> None:
        data, self._forge_staged = getattr(self, "_forge_staged", None), None
        if data is None:
            raise CheckpointError(f"{type(self).__name__}: forge_apply_load without a prepare")
        self.load_state_dict(data["state"])
        if data.get("rng") is not None:
            rng.restore(data["rng"], self.rng_generators())  # checked by prepare: cannot fail

    def forge_abort_load(self) -> None:
        self._forge_staged = None
