"""Driver-side handles on what the coordinator saves: a `Group` per registered component (the
trainer's ranks or an actor's replicas) made of `Unit`s, one per rank or replica.

The coordinator talks to every unit through the same calls and asks each group what it
differs in and what each of its units must load; it never needs to know which is the trainer.
`RemoteUnit` forwards the calls to an actor that writes its own files (a `Checkpointable`
actor or a trainer rank); `PlainUnit` adapts an actor that only has
`state_dict`/`load_state_dict` by doing the file I/O in the driver.

A group whose saved replica count differs from the registered one loads only through its
resharding rule (see reshard.py and docs/elastic.md): the driver reads and verifies the N saved
files, the rule turns the N user states into M, and each new replica receives its state through
the same prepare/apply calls as any load.
"""

from __future__ import annotations

import asyncio
import logging
import posixpath
from abc import ABC, abstractmethod
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from .. import serialization
from ..actors import rng
from ..actors.checkpointable import wrap_state
from ..actors.reshard import ReshardRule
from ..errors import CheckpointCorruptError, CheckpointMismatchError
from ..steps import layout
from ..storage import FileRecord, StorageSpec, open_storage
from .remote_errors import describe, unwrap

log = logging.getLogger("forge_ckpt")
PROTOCOL_METHOD = "forge_begin_save"
RESHARD_HOOK = "reshard_states"  # optional static method of an actor class
STATE_OPTION = "state"  # prepare's option carrying a resharded state (no file to read)
VERIFY_OPTION = "verify"  # prepare's option forcing verification (a step with digests)


def _verified(verify: bool, options: dict) -> tuple[bool, dict]:
    """The unit's `verify` and its options without the forcing one (see `must_verify`)."""
    forced = bool(options.get(VERIFY_OPTION))
    return verify or forced, {k: v for k, v in options.items() if k != VERIFY_OPTION}


@dataclass
class Unit(ABC):
    """One rank or replica; the coordinator drives every kind through these calls."""

    name: str  # component name; "trainer" for trainer ranks
    index: int  # replica index or rank
    handle: Any
    actor: bool  # an actor replica (its file is named here), not a trainer rank
    label: str = ""

    def save_path(self, attempt: str | None) -> str:
        """The file this unit writes in save attempt `attempt` (layout.actor_file); "" for a
        trainer rank, which names its own files."""
        return layout.actor_file(self.name, self.index, attempt) if self.actor else ""

    @abstractmethod
    def begin(
        self, where: StorageSpec, background: bool, defer: bool = False, attempt: str | None = None
    ) -> Awaitable[int]:
        """Submit the snapshot call now (Ray runs an actor's calls from this driver in the
        order submitted, so whatever the driver sends the actor later runs after the cut);
        awaiting the result gives the snapshot's size once taken and its write started (or,
        unless `background`, finished). `defer`: a trainer rank copies its state in the
        background and its next optimizer step waits for that copy (the stall-free cut).
        `attempt`: the save attempt, which names the files it writes."""

    @abstractmethod
    async def status(self) -> list[FileRecord] | None:
        """The written files once durable, else None (the write still runs)."""

    @abstractmethod
    async def abort_save(self, timeout_s: float) -> None:
        """Wait (bounded) for a write whose step failed, and forget it."""

    @abstractmethod
    async def prepare(
        self, where: StorageSpec, records: list[FileRecord], verify: bool, options: dict
    ) -> list[str]:
        """Read, verify and decode `records` (or take `options["state"]`, already resharded)
        without changing the actor yet; lines the actor accepted as differences, to log."""

    @abstractmethod
    async def apply(self) -> None:
        """Load what `prepare` staged into the actor."""

    @abstractmethod
    async def abort(self) -> None:
        """Drop what `prepare` staged."""


class RemoteUnit(Unit):
    """An actor that speaks the forge protocol (see actor.py and trainer.py)."""

    _files: list[FileRecord] | None = None  # reported by a synchronous begin

    def begin(
        self, where: StorageSpec, background: bool, defer: bool = False, attempt: str | None = None
    ) -> Awaitable[int]:
        self._files = None
        path = self.save_path(attempt)
        return self._begun(self.handle.forge_begin_save.remote(where, path, background, defer))

    async def _begun(self, ref: Any) -> int:
        res = await ref
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
    ) -> list[str]:
        verify, options = _verified(verify, options)
        dicts = [r.to_dict() for r in records]
        notes = await self.handle.forge_prepare_load.remote(where, dicts, verify, options)
        return list(notes or [])

    async def apply(self) -> None:
        await self.handle.forge_apply_load.remote()

    async def abort(self) -> None:
        await self.handle.forge_abort_load.remote()


class PlainUnit(Unit):
    """An actor with only `state_dict()`/`load_state_dict()`: its state passes through the driver."""

    _write: asyncio.Task | None = None
    _staged: Any = None

    def begin(
        self, where: StorageSpec, background: bool, defer: bool = False, attempt: str | None = None
    ) -> Awaitable[int]:
        return self._begun(self.handle.state_dict.remote(), where, background, attempt)

    async def _begun(
        self, ref: Any, where: StorageSpec, background: bool, attempt: str | None
    ) -> int:
        state = await ref
        # The object arrived through Ray: it is already a private copy, no snapshot copy needed.
        snap = serialization.snapshot(wrap_state(state), name=self.name, copy=False)
        path = self.save_path(attempt)
        self._write = asyncio.create_task(asyncio.to_thread(self._persist, snap, where, path))
        if not background:
            await asyncio.shield(self._write)
        return snap.nbytes

    @staticmethod
    def _persist(snap: serialization.Snapshot, where: StorageSpec, path: str) -> FileRecord:
        store = open_storage(where)
        rec = snap.write_to(store, path)
        store.sync_dir(posixpath.dirname(path))
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
    ) -> list[str]:
        verify, options = _verified(verify, options)
        if STATE_OPTION in options:
            self._staged = options[STATE_OPTION]
            return []
        (record,) = records
        store = open_storage(where)
        load = serialization.load_from
        self._staged = await asyncio.to_thread(load, store, record.path, record if verify else None)
        return []

    async def apply(self) -> None:
        staged, self._staged = self._staged, None
        await self.handle.load_state_dict.remote(staged["state"])

    async def abort(self) -> None:
        self._staged = None


LoadPlan = list[tuple[Unit, list[FileRecord], dict[str, Any]]]


class Group:
    """An actor registered under one name, with its replicas (kept apart: replica i saves and
    loads file i). Another replica count loads only through a resharding rule: `reshard`
    given at registration, else the actor class's `reshard_states` run on new replica 0 (the
    driver has no class object, only handles)."""

    kind = "actor"
    members = "replicas"

    def keep_fresh(self) -> str:
        """How to load a checkpoint that lacks this component."""
        return f"register({self.name!r}, ..., optional=True)"

    def __init__(
        self,
        name: str,
        units: list[Unit],
        reshard: ReshardRule | None = None,
        optional: bool = False,
    ) -> None:
        self.name, self.units = name, units
        self.reshard, self.optional = reshard, optional
        self.hook = reshard is None and bool(units) and hasattr(units[0].handle, RESHARD_HOOK)

    def rule_name(self) -> str | None:
        """How this group reshards, for messages; None without a rule."""
        if self.reshard is not None:
            return getattr(self.reshard, "__qualname__", None) or repr(self.reshard)
        if self.hook:
            desc = getattr(self.units[0].handle, "_ray_actor_creation_function_descriptor", None)
            return f"{getattr(desc, 'class_name', 'the actor class')}.{RESHARD_HOOK}"
        return None

    def changed(self, saved: layout.Component) -> str:
        return (
            f"{self.name}: {self.members} changed: checkpoint={saved.replicas}, "
            f"current={len(self.units)}"
        )

    def differences(self, saved: layout.Component) -> list[str]:
        if saved.replicas == len(self.units) or self.rule_name() is not None:
            return []
        return [
            f"{self.changed(saved)}. No resharding rule: pass register({self.name!r}, actors, "
            f"reshard=rule) or give the actor class a static method {RESHARD_HOOK}(states, "
            "replicas); forge_ckpt.actors.reshard has ready-made rules"
        ]

    async def plan(
        self, saved: layout.Component, exclude: set[str], where: StorageSpec, verify: bool
    ) -> LoadPlan:
        files = layout.replica_files(saved, self.name)
        lost = [i for i in range(saved.replicas) if i not in files]
        if lost:  # a save writes every replica's file: the manifest is not one a save wrote
            raise CheckpointCorruptError(
                layout.MANIFEST,
                f"it records {saved.replicas} replica(s) of {self.name!r} but names no file "
                f"for replica(s) {lost}",
            )
        if saved.replicas != len(self.units) and self.rule_name() is not None:
            return await self._resharded(saved, files, where, verify)
        missing = [u for u in self.units if u.index not in files]
        if missing:
            raise CheckpointMismatchError(
                [
                    f"{self.name}: the checkpoint holds no file for replica(s) "
                    f"{[u.index for u in missing]} (it has {saved.replicas} replica(s))"
                ],
                "register as many replicas as were saved, or declare a resharding rule",
            )
        return [(u, [files[u.index]], {}) for u in self.units]

    async def _resharded(
        self,
        saved: layout.Component,
        files: dict[int, FileRecord],
        where: StorageSpec,
        verify: bool,
    ) -> LoadPlan:
        """Read and verify the N saved files, let the rule make M states; replica j < N keeps
        the RNG streams of saved replica j, an added one (j >= N) gets streams derived from
        saved replica j mod N's by `rng.derive` (distinct ones; the trainer ranks' rule)."""
        n = saved.replicas  # plan() checked that each has its file
        store = open_storage(where)
        load = serialization.load_from
        recs = [files[i] for i in range(n)]
        saved_data = await asyncio.gather(
            *(asyncio.to_thread(load, store, r.path, r if verify else None) for r in recs)
        )
        states = await self._run_rule([d["state"] for d in saved_data], n)
        log.warning("%s; resharded by %s", self.changed(saved), self.rule_name())
        return [
            (u, [], {STATE_OPTION: wrap_state(states[j], _replica_rng(saved_data, j))})
            for j, u in enumerate(self.units)
        ]

    async def _run_rule(self, states: list[Any], n: int) -> list[Any]:
        m = len(self.units)
        try:
            if self.reshard is not None:
                out = await asyncio.to_thread(self.reshard, states, m)
            else:
                out = await getattr(self.units[0].handle, RESHARD_HOOK).remote(states, m)
            out = list(out)
            if len(out) != m:
                raise ValueError(f"it returned {len(out)} states for {m} replicas")
        except Exception as e:
            raise CheckpointMismatchError(
                [
                    f"{self.name}: resharding rule {self.rule_name()} failed "
                    f"(checkpoint={n} {self.members}, current={m}): {describe(unwrap(e))}"
                ],
                f"fix the rule, or resume {self.name!r} with {n} {self.members}; nothing was "
                "loaded",
            ) from e
        return out


def _replica_rng(saved_data: list[Any], j: int) -> Any:
    """Replica j's streams: saved replica j's, or derived from j mod N's when j is new."""
    saved = saved_data[j % len(saved_data)].get("rng")
    if j < len(saved_data) or saved is None:
        return saved
    return rng.derive(saved, j)


class TrainerGroup(Group):
    """The trainer's ranks. A change of world size (N saved, M now) is not a mismatch: DCP
    reshards model, optimizer and LR state, and every rank reads the pieces it needs. The
    per-rank RNG streams follow one deterministic rule: rank r restores the streams saved by
    rank r mod N (N -> M with M < N drops ranks M..N-1's streams); an added rank (r >= N) gets
    streams derived from those by `rng.derive(streams, r)`: distinct from every other rank's."""

    kind = "trainer"
    members = "trainer ranks"

    def keep_fresh(self) -> str:
        return f"load(exclude=[{self.name!r}])"

    def differences(self, saved: layout.Component) -> list[str]:
        return []  # any world size loads; see plan()

    async def plan(
        self, saved: layout.Component, exclude: set[str], where: StorageSpec, verify: bool
    ) -> LoadPlan:
        n = saved.replicas
        if n != len(self.units):
            log.warning(
                "%s; DCP reshards the trainer state, rank r restores the RNG streams of saved "
                "rank r mod %d (derived ones for an added rank, rng.derive)",
                self.changed(saved),
                n,
            )
        load_optimizer = "optimizer" not in exclude
        return [
            (
                u,
                saved.files,
                {
                    "load_optimizer": load_optimizer,
                    "rank_file": layout.trainer_rank_file(u.index % n),
                    "saved_rank": u.index % n,
                },
            )
            for u in self.units
        ]


def differences(
    groups: dict[str, Group], manifest: layout.Manifest, exclude: set[str]
) -> list[str]:
    """Every way the registered components differ from the checkpoint's, each with its remedy."""
    saved, step = manifest.components, manifest.step
    diffs: list[str] = []
    for name in sorted(set(saved) | set(groups)):
        if name in exclude:
            continue
        if name not in groups:
            diffs.append(
                f"{name}: in the checkpoint (step {step}) but not registered; register it, or "
                f"load(exclude=[{name!r}]) to leave it out"
            )
        elif name not in saved and not groups[name].optional:
            diffs.append(
                f"{name}: registered but not in the checkpoint (step {step}); "
                f"{groups[name].keep_fresh()} keeps its fresh state"
            )
        elif name in saved:
            diffs += groups[name].differences(saved[name])
    return diffs


async def load_plan(
    groups: dict[str, Group],
    manifest: layout.Manifest,
    exclude: set[str],
    where: StorageSpec,
    verify: bool,
) -> LoadPlan:
    """Which unit loads what; resharded states are made here, before any unit prepares.
    A step whose files carry digests is verified whatever `verify` says (see must_verify)."""
    if not verify and must_verify(manifest):
        log.info("step %d is signed (or has digests): verifying it despite verify_on_load=False",
                 manifest.step)  # fmt: skip
        forced = await load_plan(groups, manifest, exclude, where, True)
        return [(u, recs, {**opts, VERIFY_OPTION: True}) for u, recs, opts in forced]
    plan: LoadPlan = []
    for name, group in groups.items():
        if name in exclude:
            continue
        if name not in manifest.components:
            if group.optional:
                log.warning("%s: not in step %d; keeps its fresh state", name, manifest.step)
            continue
        plan += await group.plan(manifest.components[name], exclude, where, verify)
    return plan


def must_verify(manifest: layout.Manifest) -> bool:
    """A step whose files carry cryptographic digests (every signed step does) is always
    checked against them: `verify_on_load=False` skips only the CRC32C checks of steps without
    digests. Otherwise turning verification off would load a signed step's files unchecked,
    and a signature would prove nothing about the bytes loaded."""
    return any(f.digest for f in manifest.files)


def make_unit(name: str, index: int, handle: Any, actor: bool, label: str) -> Unit:
    """A RemoteUnit when the actor implements the protocol, else a PlainUnit."""
    if hasattr(handle, PROTOCOL_METHOD):
        return RemoteUnit(name, index, handle, actor, label)
    for method in ("state_dict", "load_state_dict"):
        if not hasattr(handle, method):
            raise TypeError(
                f"actor {name!r} has no {method}() method: give it state_dict() and "
                "load_state_dict(state), or inherit forge_ckpt.Checkpointable"
            )
    return PlainUnit(name, index, handle, actor, label)


def actor_group(
    name: str, handles: list[Any], reshard: ReshardRule | None = None, optional: bool = False
) -> Group:
    units = [
        make_unit(name, i, h, True, f"actor {name!r} replica {i}") for i, h in enumerate(handles)
    ]
    return Group(name, units, reshard, optional)


def trainer_group(handles: list[Any]) -> TrainerGroup:
    name = layout.TRAINER
    units = [make_unit(name, r, h, False, f"trainer rank {r}") for r, h in enumerate(handles)]
    return TrainerGroup(name, units)
