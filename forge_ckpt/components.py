"""Driver-side handles on what the coordinator saves: a `Group` per registered component (the
trainer's ranks or an actor's replicas) made of `Unit`s, one per rank or replica.

The coordinator talks to every unit through the same calls and asks each group what it
differs in and what each of its units must load; it never needs to know which is the trainer.
`RemoteUnit` forwards the calls to an actor that writes its own files (a `Checkpointable`
actor or a trainer rank); `PlainUnit` adapts an actor that only has
`state_dict`/`load_state_dict` by doing the file I/O in the driver.
"""

from __future__ import annotations

import asyncio
import posixpath
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from . import layout, serialization
from .actor import wrap_state
from .errors import CheckpointMismatchError
from .storage import FileRecord, StorageSpec, open_storage

PROTOCOL_METHOD = "forge_begin_save"


@dataclass
class Unit(ABC):
    """One rank or replica; the coordinator drives every kind through these calls."""

    name: str  # component name; "trainer" for trainer ranks
    index: int  # replica index or rank
    handle: Any
    relpath: str  # the actor's file; "" for trainer ranks (they name their own files)
    label: str = ""

    @abstractmethod
    async def begin(self, where: StorageSpec, background: bool) -> int:
        """Take the snapshot and start (or, unless `background`, finish) its write; its size."""

    @abstractmethod
    async def status(self) -> list[FileRecord] | None:
        """The written files once durable, else None (the write still runs)."""

    @abstractmethod
    async def abort_save(self, timeout_s: float) -> None:
        """Wait (bounded) for a write whose step failed, and forget it."""

    @abstractmethod
    async def prepare(
        self, where: StorageSpec, records: list[FileRecord], verify: bool, options: dict
    ) -> None:
        """Read, verify and decode `records` without changing the actor yet."""

    @abstractmethod
    async def apply(self) -> None:
        """Load what `prepare` staged into the actor."""

    @abstractmethod
    async def abort(self) -> None:
        """Drop what `prepare` staged."""


class RemoteUnit(Unit):
    """An actor that speaks the forge protocol (see actor.py and trainer.py)."""

    _files: list[FileRecord] | None = None  # reported by a synchronous begin

    async def begin(self, where: StorageSpec, background: bool) -> int:
        self._files = None
        res = await self.handle.forge_begin_save.remote(where, self.relpath, background)
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

    async def abort_save(self, timeout_s: float) -> None:
        self._files = None
        await self.handle.forge_abort_save.remote(timeout_s)

    async def prepare(
        self, where: StorageSpec, records: list[FileRecord], verify: bool, options: dict
    ) -> None:
        dicts = [r.to_dict() for r in records]
        await self.handle.forge_prepare_load.remote(where, dicts, verify, options)

    async def apply(self) -> None:
        await self.handle.forge_apply_load.remote()

    async def abort(self) -> None:
        await self.handle.forge_abort_load.remote()


class PlainUnit(Unit):
    """An actor with only `state_dict()`/`load_state_dict()`: its state passes through the driver."""

    _write: asyncio.Task | None = None
    _staged: Any = None

    async def begin(self, where: StorageSpec, background: bool) -> int:
        state = await self.handle.state_dict.remote()
        # The object arrived through Ray: it is already a private copy, no snapshot copy needed.
        snap = serialization.snapshot(wrap_state(state), name=self.name, copy=False)
        self._write = asyncio.create_task(asyncio.to_thread(self._persist, snap, where))
        if not background:
            await asyncio.shield(self._write)
        return snap.nbytes

    def _persist(self, snap: serialization.Snapshot, where: StorageSpec) -> FileRecord:
        store = open_storage(where)
        rec = snap.write_to(store, self.relpath)
        store.sync_dir(posixpath.dirname(self.relpath))
        return rec

    async def status(self) -> list[FileRecord] | None:
        assert self._write is not None
        if not self._write.done():
            return None
        return [self._write.result()]

    async def abort_save(self, timeout_s: float) -> None:
        write, self._write = self._write, None
        if write is not None:
            await asyncio.wait([write], timeout=timeout_s)

    async def prepare(
        self, where: StorageSpec, records: list[FileRecord], verify: bool, options: dict
    ) -> None:
        (record,) = records
        store = open_storage(where)
        load = serialization.load_from
        self._staged = await asyncio.to_thread(load, store, record.path, record if verify else None)

    async def apply(self) -> None:
        staged, self._staged = self._staged, None
        await self.handle.load_state_dict.remote(staged["state"])

    async def abort(self) -> None:
        self._staged = None


LoadPlan = list[tuple[Unit, list[FileRecord], dict[str, Any]]]


class Group:
    """An actor registered under one name, with its replicas (kept apart: replica i saves and
    loads file i)."""

    kind = "actor"
    members = "replicas"

    def __init__(self, name: str, units: list[Unit]) -> None:
        self.name, self.units = name, units

    def differences(self, saved: layout.Component) -> list[str]:
        if saved.replicas != len(self.units):
            return [
                f"{self.name}: {self.members} changed: checkpoint={saved.replicas}, "
                f"current={len(self.units)}"
            ]
        return []

    def plan(self, saved: layout.Component, exclude: set[str]) -> LoadPlan:
        by_path = {f.path: f for f in saved.files}
        missing = [u for u in self.units if u.relpath not in by_path]
        if missing:
            raise CheckpointMismatchError(
                [
                    f"{self.name}: the checkpoint holds no file for replica(s) "
                    f"{[u.index for u in missing]} (it has {saved.replicas} replica(s))"
                ],
                "register as many replicas as were saved",
            )
        return [(u, [by_path[u.relpath]], {}) for u in self.units]


class TrainerGroup(Group):
    """The trainer's ranks. A change of world size (N saved, M now) is not a mismatch: DCP
    reshards model, optimizer and LR state, and every rank reads the pieces it needs. The
    per-rank RNG streams follow one deterministic rule: rank r restores the streams saved by
    rank r mod N (N -> M with M < N drops ranks M..N-1's streams; with M > N several ranks
    start from the same saved streams, as ranks seeded alike would)."""

    kind = "trainer"
    members = "trainer ranks"

    def differences(self, saved: layout.Component) -> list[str]:
        return []  # any world size loads; see plan()

    def plan(self, saved: layout.Component, exclude: set[str]) -> LoadPlan:
        load_optimizer = "optimizer" not in exclude
        return [
            (
                u,
                saved.files,
                {
                    "load_optimizer": load_optimizer,
                    "rank_file": layout.trainer_rank_file(u.index % saved.replicas),
                    "saved_rank": u.index % saved.replicas,
                },
            )
            for u in self.units
        ]


def make_unit(name: str, index: int, handle: Any, relpath: str, label: str) -> Unit:
    """A RemoteUnit when the actor implements the protocol, else a PlainUnit."""
    if hasattr(handle, PROTOCOL_METHOD):
        return RemoteUnit(name, index, handle, relpath, label)
    for method in ("state_dict", "load_state_dict"):
        if not hasattr(handle, method):
            raise TypeError(
                f"actor {name!r} has no {method}() method: give it state_dict() and "
                "load_state_dict(state), or inherit forge_ckpt.Checkpointable"
            )
    return PlainUnit(name, index, handle, relpath, label)


def actor_group(name: str, handles: list[Any]) -> Group:
    return Group(
        name,
        [
            make_unit(name, i, h, layout.actor_file(name, i), f"actor {name!r} replica {i}")
            for i, h in enumerate(handles)
        ],
    )


def trainer_group(handles: list[Any]) -> TrainerGroup:
    name = layout.TRAINER
    units = [make_unit(name, r, h, "", f"trainer rank {r}") for r, h in enumerate(handles)]
    return TrainerGroup(name, units)
