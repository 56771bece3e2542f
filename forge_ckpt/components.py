"""Driver-side handles on what the coordinator saves: one `Unit` per actor replica or trainer rank.

The coordinator talks to every unit through the same five async calls; `RemoteUnit` forwards
them to an actor that writes its own files (a `Checkpointable` actor or a trainer rank), and
`PlainUnit` adapts an actor that only has `state_dict`/`load_state_dict` by doing the file I/O
in the driver.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

from . import serialization
from .actor import wrap_state
from .storage import FileRecord

PROTOCOL_METHOD = "forge_begin_save"


@dataclass
class Unit:
    name: str  # component name; "trainer" for trainer ranks
    index: int  # replica index or rank
    handle: Any
    relpath: str  # actor file; "" for trainer ranks (they name their own files)

    @property
    def label(self) -> str:
        if self.name == "trainer":
            return f"trainer rank {self.index}"
        return f"actor {self.name!r} replica {self.index}"


class RemoteUnit(Unit):
    """An actor that speaks the forge protocol (see actor.py and trainer.py)."""

    _files: list[FileRecord] | None = None  # reported by a synchronous begin

    async def begin(self, step_dir: str, background: bool) -> int:
        self._files = None
        res = await self.handle.forge_begin_save.remote(step_dir, self.relpath, background)
        # A synchronous write reports its files with the size: no second round trip (with
        # many actors, one round of calls to all of them costs tens of milliseconds).
        files = res.get("files")
        self._files = None if files is None else [FileRecord.from_dict(r) for r in files]
        return int(res["nbytes"])

    async def status(self) -> list[FileRecord] | None:
        if self._files is not None:
            files, self._files = self._files, None
            return files
        recs = await self.handle.forge_save_status.remote()
        return None if recs is None else [FileRecord.from_dict(r) for r in recs]

    async def prepare(self, step_dir: str, records: list[FileRecord], verify: bool, options: dict):
        dicts = [r.to_dict() for r in records]
        await self.handle.forge_prepare_load.remote(step_dir, dicts, verify, options)

    async def apply(self) -> None:
        await self.handle.forge_apply_load.remote()

    async def abort(self) -> None:
        await self.handle.forge_abort_load.remote()


class PlainUnit(Unit):
    """An actor with only `state_dict()`/`load_state_dict()`: its state passes through the driver."""

    _write: asyncio.Task | None = None
    _staged: Any = None

    async def begin(self, step_dir: str, background: bool) -> int:
        state = await self.handle.state_dict.remote()
        # The object arrived through Ray: it is already a private copy, no snapshot copy needed.
        snap = serialization.snapshot(wrap_state(state), name=self.name, copy=False)
        path = os.path.join(step_dir, self.relpath)
        self._write = asyncio.create_task(asyncio.to_thread(snap.write, path, self.relpath))
        if not background:
            await asyncio.shield(self._write)
        return snap.nbytes

    async def status(self) -> list[FileRecord] | None:
        assert self._write is not None
        if not self._write.done():
            return None
        return [self._write.result()]

    async def prepare(self, step_dir: str, records: list[FileRecord], verify: bool, options: dict):
        (record,) = records
        path = os.path.join(step_dir, record.path)
        self._staged = await asyncio.to_thread(serialization.load, path, record if verify else None)

    async def apply(self) -> None:
        staged, self._staged = self._staged, None
        await self.handle.load_state_dict.remote(staged["state"])

    async def abort(self) -> None:
        self._staged = None


def make_unit(name: str, index: int, handle: Any, relpath: str) -> Unit:
    """A RemoteUnit when the actor implements the protocol, else a PlainUnit."""
    if hasattr(handle, PROTOCOL_METHOD):
        return RemoteUnit(name, index, handle, relpath)
    for method in ("state_dict", "load_state_dict"):
        if not hasattr(handle, method):
            raise TypeError(
                f"actor {name!r} has no {method}() method: give it state_dict() and "
                "load_state_dict(state), or inherit forge_ckpt.Checkpointable"
            )
    return PlainUnit(name, index, handle, relpath)
