"""Review 21: a stale job's late write in the memory tier, from another node than its
successor's writer. Each holder refuses a step's file only where it keeps one of that name
(create-only puts), and which holders get a file's copies depends on the writer's node: the
stale write is refused by one holder and lands on another, which then keeps a file that is
not the committed one. A verified read must still return the committed bytes (another
holder's copy), and a persist must write a copy that matches the manifest.

Real `Holder` objects with their real listeners in this process, one per simulated node,
behind a minimal stand-in for Ray (`cluster.install`): the placement, the streams, the
refusals and the reads are the product's own.
"""

from __future__ import annotations

import asyncio
import os
import types
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest

from forge_ckpt.errors import CheckpointCorruptError
from forge_ckpt.memory import cluster, transport
from forge_ckpt.memory import store as memstore
from forge_ckpt.memory.holder import Holder
from forge_ckpt.memory.placement import holder_name
from forge_ckpt.memory.tier import MemoryTier
from forge_ckpt.memory.transport import Server
from forge_ckpt.steps import layout
from forge_ckpt.storage import FileRecord, StorageSpec, open_storage
from forge_ckpt.storage.base import AlreadyExistsError

NODES = ("A", "B", "C")
PATH = "step-5/trainer/__0_0.distcp"


class _Done:
    """A call's outcome, as a Ray object ref would carry it (awaitable, as a ref is)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        try:
            self.value, self.error = fn(), None
        except Exception as e:  # raised by `get`, as Ray raises a task's error
            self.value, self.error = None, e

    def __await__(self) -> Generator[None, None, Any]:
        if self.error is not None:
            raise self.error
        return self.value
        yield  # a generator: what `await` needs


class _Method:
    def __init__(self, obj: Any, name: str) -> None:
        self.obj, self.name = obj, name

    def remote(self, *args: Any) -> _Done:
        return _Done(lambda: getattr(self.obj, self.name)(*args))


class _Handle:
    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.obj, name)


class Nodes(cluster.RayCluster):
    """Three nodes in this process; `me` is the node the caller runs on."""

    def __init__(self) -> None:
        super().__init__()
        self.me, self.holders = NODES[0], {}

    def ready(self) -> bool:
        return True

    def nodes(self) -> list[str]:
        return list(NODES)

    def node_id(self) -> str:
        return self.me

    def actor(self, name: str, namespace: str) -> _Handle:
        if name not in self.holders:
            raise ValueError(name)
        return _Handle(self.holders[name])

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        if not isinstance(ref, _Done):  # an object `put` stored: the object itself
            return ref
        if ref.error is not None:
            raise ref.error
        return ref.value

    def put(self, obj: Any) -> Any:
        return obj


@pytest.fixture
def tier() -> Iterator[tuple[Nodes, Any, dict[str, Holder]]]:
    nodes = Nodes()
    old = cluster.install(nodes)
    servers, refs, by_node = [], [], {}
    try:
        for n in NODES:
            nodes.me = n
            h = Holder("run", "fp", budget=1 << 26, keep=4, listen=False)
            h._server = Server("127.0.0.1", h)
            servers.append(h._server)
            name = holder_name("run", n)
            nodes.holders[name] = by_node[n] = h
            refs.append((name, n))
        spec = StorageSpec("mem://run", {"holders": tuple(refs), "copies": 2})
        store = open_storage(spec)
        yield nodes, store, by_node
    finally:
        for s in servers:
            s.stop()
            transport._POOL.drop(s.endpoint)  # this process's idle connections to it
        for name, _ in refs:  # the next test's holders of these names listen elsewhere
            memstore.forget(store.namespace, name)
        cluster.install(old)


def put(nodes: Nodes, store: Any, node: str, data: bytes) -> FileRecord:
    """A trainer rank on `node` writes the step's file (create-only, as every step file)."""
    nodes.me = node
    with store.writer(PATH, exclusive=True) as w:
        w.write(data)
        return w.close()


def test_a_late_write_from_another_node_never_replaces_what_a_verified_read_returns(tier):
    nodes, store, holders = tier
    committed, stale = os.urandom(200_000), os.urandom(200_000)
    rec = put(nodes, store, "B", committed)  # the successor's rank on B: copies on A and C
    with pytest.raises(AlreadyExistsError, match="another writer"):
        put(nodes, store, "C", stale)  # the stale rank on C, late: A refuses it, B takes it
    kept = {n: h.files.get(PATH) for n, h in holders.items()}
    print(
        {
            n: None if d is None else "committed" if d == committed else "stale"
            for n, d in kept.items()
        }
    )
    assert [n for n, d in kept.items() if d == stale] == ["B"]  # (the case this test is for)
    for n in NODES:  # B's own copy first, by preference: it is not the committed file
        nodes.me = n
        assert bytes(store.read_verified(PATH, rec)) == committed, n
    # the persist's owner: a holder whose copy matches the manifest's record
    matching = [holders[n].has([PATH], [(rec.size, rec.crc32c)]) for n in NODES]
    assert matching == [[True], [False], [True]]


def persisted(store: Any, rec: FileRecord, folder: Any) -> tuple[list[FileRecord], bytes]:
    """What a persist of a step holding only this file writes to the durable `folder`: the
    records it reports (`MemoryTier.persist` checks them against the manifest) and bytes."""
    inside = PATH.split("/", 1)[1]  # the file's path in its step
    files = [FileRecord(inside, rec.size, rec.crc32c)]
    manifest = layout.Manifest(
        step=5, components={"trainer": layout.Component("trainer", 1, files)}
    )
    (folder / "step-5" / "trainer").mkdir(parents=True)  # what prepare_step makes

    async def run(fn: Any, *args: Any) -> Any:
        return fn(*args)

    tier = types.SimpleNamespace(store=store, to_thread=run)
    spec = StorageSpec(str(folder / "step-5"))
    written = asyncio.run(MemoryTier._holders_write(tier, manifest, spec))  # type: ignore[arg-type]
    return written, (folder / "step-5" / inside).read_bytes()


@pytest.mark.parametrize("holders", ["current", "earlier release"])
def test_a_persist_writes_a_copy_that_matches_the_manifest(tier, tmp_path, monkeypatch, holders):
    """B keeps the stale copy and comes first for the persist: the owner is a holder whose
    copy matches. Holders of an earlier release (a driver upgraded within a live run adopts
    them) take `has(keys)` only: the persist still runs (checked against the manifest after
    the write, as before)."""
    nodes, store, by_node = tier
    committed, stale = os.urandom(200_000), os.urandom(200_000)
    rec = put(nodes, store, "B", committed)
    with pytest.raises(AlreadyExistsError):
        put(nodes, store, "C", stale)
    store.holders = tuple(sorted(store.holders, key=lambda r: r[1] != "B"))  # B asked first
    if holders == "earlier release":
        for h in by_node.values():
            monkeypatch.setattr(h, "has", _keys_only(h))
        [written], data = persisted(store, rec, tmp_path)  # no TypeError: it ran
        assert data in (committed, stale)  # an old holder cannot say which copy matches,
        assert (written.crc32c == rec.crc32c) == (data == committed)  # the check after can
        return
    [written], data = persisted(store, rec, tmp_path)
    assert data == committed and written.crc32c == rec.crc32c


def _keys_only(h: Holder) -> Callable[[list[str]], list[bool]]:
    def has(keys: list[str]) -> list[bool]:  # an earlier release's signature
        return [k in h.files for k in keys]

    return has


def test_no_matching_copy_raises_the_first_reads_error(tier):
    """A record no copy matches (every copy shorter): the first read's own error, which says
    why (size, or checksum), not a generic one."""
    nodes, store, _ = tier
    rec = put(nodes, store, "B", os.urandom(50_000))
    longer = FileRecord(rec.path, rec.size + 10, rec.crc32c)
    with pytest.raises(CheckpointCorruptError, match="size is 50000 bytes"):
        store.read_verified(PATH, longer)
