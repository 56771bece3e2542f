"""Phase timers: where the time of a save or load goes, inside each process.

The timers wrap forge_ckpt's own functions inside each process (by module attribute, the way
the library calls them), so a benchmark run also says where the time of a save or load went.
They cost a `perf_counter()` pair per call on calls that move megabytes; a wrapped name that
the library no longer has is skipped, never an error.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from typing import Any

_PHASES: dict[str, float] = defaultdict(float)
_CALLS: dict[str, int] = defaultdict(int)
_END: dict[str, float] = {}  # wall-clock time (time.time()) a phase last finished
_INSTALLED: set[str] = set()


def timed(name: str, fn: Any) -> Any:
    """`fn`, adding its seconds, calls and end time to the phase `name`."""
    if getattr(fn, "_bench_timed", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _PHASES[name] += time.perf_counter() - start
            _CALLS[name] += 1
            _END[name] = time.time()

    wrapper._bench_timed = True  # type: ignore[attr-defined]
    return wrapper


def _patch(owner: Any, attr: str, name: str) -> None:
    fn = getattr(owner, attr, None)
    if callable(fn):
        setattr(owner, attr, timed(name, fn))


class _TimedCrc:
    """Stands in for the `crc32c` module inside forge_ckpt.storage: times every checksum."""

    def __init__(self, mod: Any) -> None:
        self._mod = mod
        self.crc32c = timed("crc32c", mod.crc32c)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._mod, attr)


def install_timers(kind: str) -> None:
    """Wrap the library's I/O steps in this process; `kind` is 'driver', 'trainer' or 'actor'."""
    if kind in _INSTALLED:
        return
    _INSTALLED.add(kind)
    from forge_ckpt import serialization
    from forge_ckpt.storage import base, local

    if kind == "driver":
        from forge_ckpt.steps import commit

        _patch(commit, "prepare_step", "prepare_step")
        _patch(commit, "commit_step", "commit")
        _patch(commit, "apply_retention", "retention")
        return
    if not isinstance(base._crc32c, _TimedCrc):
        base._crc32c = _TimedCrc(base._crc32c)
    _patch(local.LocalWriter, "close", "fsync_file")
    _patch(serialization, "snapshot", "snapshot")
    _patch(serialization.Snapshot, "write_to", "file_write")
    _patch(local.LocalStorage, "read_verified", "read_verified")
    _patch(local.LocalStorage, "read_buffer", "read_verified")  # actor files: read + crc32c
    _patch(serialization, "load_from", "file_load")
    if kind == "trainer":
        import torch.distributed.checkpoint as dcp

        from forge_ckpt.trainer import checkpointer as trainer

        _patch(dcp, "save", "dcp_save")
        _patch(dcp, "load", "dcp_load")
        _patch(local, "fsync_dir", "fsync_dir")
        _patch(local.LocalStorage, "verify", "verify")
        _patch(trainer.TrainerCheckpointer, "_stage", "stage_copy")
        _patch(trainer.TrainerCheckpointer, "_write", "write_total")
        _patch(trainer.TrainerCheckpointer, "begin_save", "begin_save")
        _patch(trainer.TrainerCheckpointer, "prepare_load", "prepare_load")
        _patch(trainer.TrainerCheckpointer, "apply_load", "apply_load")


def timed_call(name: str, fn: Any, *args: Any) -> Any:
    """Call fn(*args) under the phase timer `name` (for methods Ray dispatches: Ray binds an
    actor's methods when the actor is created, so patching the class afterwards is not seen)."""
    return timed(name, fn)(*args)


def take_phases() -> dict[str, Any]:
    """The phase totals since the last call (seconds, call counts, wall-clock end times)."""
    out = {
        "seconds": dict(_PHASES),
        "calls": dict(_CALLS),
        "end": dict(_END),
    }
    _PHASES.clear()
    _CALLS.clear()
    _END.clear()
    return out


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
