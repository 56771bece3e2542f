"""Review 21: a stale job's late write in the memory tier, from another node than its
successor's writer. Each holder refuses a step's file only where it keeps one of that name
(create-only puts), and which holders get a file's copies depends on the writer's node: the
stale write is refused by one holder and lands on another, which then keeps a file that is
not the committed one. A verified read must still return the committed bytes (another
holder's copy), and a persist must write a copy that matches the manifest.

Here both jobs write unfenced (no lease generation: a holder's create-only puts alone);
test_memory_fence.py has the same race with the lease generation, where the holders refuse
the stale write outright. Holders: `_mem_nodes.py`.
"""

from __future__ import annotations

import asyncio
import os
import types
from collections.abc import Callable, Iterator
from typing import Any

import _mem_nodes
import pytest
import ray
from _mem_nodes import NODES, PATH, put, three_nodes

from forge_ckpt.errors import CheckpointCorruptError, CheckpointError
from forge_ckpt.memory import calls as holder_calls
from forge_ckpt.memory.holder import Holder
from forge_ckpt.memory.placement import holder_name
from forge_ckpt.memory.tier import MemoryTier
from forge_ckpt.steps import layout
from forge_ckpt.storage import FileRecord, StorageSpec
from forge_ckpt.storage.base import AlreadyExistsError


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


@pytest.fixture
def tier() -> Iterator[Any]:
    with three_nodes() as t:
        yield t


def persisted(store: Any, rec: FileRecord, folder: Any) -> tuple[list[FileRecord], bytes]:
    """What a persist of a step holding only this file writes to the durable `folder`: the
    records it reports (`MemoryTier.persist` checks them against the manifest) and bytes."""
    inside = PATH.split("/", 1)[1]  # the file's path in its step
    files = [FileRecord(inside, rec.size, rec.crc32c)]
    manifest = layout.Manifest(
        step=5, components={"trainer": layout.Component("trainer", 1, files)}
    )
    (folder / "step-5" / "trainer").mkdir(parents=True)  # what prepare_step makes

    async def run(fn: Any, *args: Any, **kw: Any) -> Any:
        return fn(*args, **kw)

    tier = types.SimpleNamespace(store=store, to_thread=run)
    spec = StorageSpec(str(folder / "step-5"))
    written = asyncio.run(MemoryTier._holders_write(tier, manifest, spec))  # type: ignore[arg-type]
    return written, (folder / "step-5" / inside).read_bytes()


@pytest.mark.parametrize("holders", ["current", "earlier release", "B of an earlier release"])
def test_a_persist_writes_a_copy_that_matches_the_manifest(tier, tmp_path, monkeypatch, holders):
    """B keeps the stale copy and comes first for the persist: the owner is a holder whose
    copy matches. Holders of an earlier release (a driver upgraded within a live run adopts
    them) take `has(keys)` only: the persist still runs (checked against the manifest after
    the write, as before). With B alone of an earlier release (a node that joined since got a
    holder of this release), the others still say which copy matches, and B comes last."""
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
    if holders == "B of an earlier release":
        monkeypatch.setattr(by_node["B"], "has", _keys_only(by_node["B"]))
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


def test_a_dead_holders_call_goes_with_the_records_to_the_holder_of_its_name_now(
    tier, tmp_path, monkeypatch
):
    """Review 32: B's cached handle is a dead holder of an earlier release (Ray refuses the
    records as the call is submitted), and B's name has a holder of this release now. Asked
    again, that holder gets the records: its stale copy is not taken for a match, and with no
    other copy left that matches, the persist says so instead of writing the stale one."""
    _mem_nodes.check_arguments_at_submission(monkeypatch)
    nodes, store, by_node = tier
    committed, stale = os.urandom(200_000), os.urandom(200_000)
    rec = put(nodes, store, "B", committed)
    with pytest.raises(AlreadyExistsError):
        put(nodes, store, "C", stale)  # B keeps the stale copy
    store.holders = tuple(sorted(store.holders, key=lambda r: r[1] != "B"))
    asked: list[bool] = []
    b_has = by_node["B"].has

    def has(keys: list[str], records: Any = None) -> list[bool]:
        asked.append(records is not None)
        return b_has(keys, records)

    monkeypatch.setattr(by_node["B"], "has", has)
    by_node["A"].files.pop(PATH)  # the committed copies: A's lost, C's damaged
    by_node["C"].files[PATH] = b"x" * rec.size
    holder_calls._handles[(store.namespace, holder_name("run", "B"))] = _mem_nodes._Handle(
        _DeadOld()
    )
    with pytest.raises(CheckpointError, match="no copy left that matches"):
        persisted(store, rec, tmp_path)
    assert asked == [True]


class _DeadOld:
    """A holder of an earlier release (keys only) that died."""

    def has(self, keys: list[str]) -> list[bool]:
        raise ray.exceptions.RayActorError()


def test_a_holder_that_dies_before_its_call_without_the_records_is_left_out(tier, tmp_path):
    """Review 32: B refuses the records (an earlier release) and its node dies before it is
    asked without them: it is left out as any dead holder is, and the persist writes the
    committed copy another holder keeps (it raised the holder lookup's ValueError)."""
    nodes, store, by_node = tier
    committed, stale = os.urandom(200_000), os.urandom(200_000)
    rec = put(nodes, store, "B", committed)
    with pytest.raises(AlreadyExistsError):
        put(nodes, store, "C", stale)
    store.holders = tuple(sorted(store.holders, key=lambda r: r[1] != "B"))
    name = holder_name("run", "B")

    def has(keys: list[str], *records: Any) -> list[bool]:
        if not records:  # (asked on its cached handle once its node is gone)
            raise ray.exceptions.RayActorError()
        nodes.holders.pop(name)  # B's node dies as it answers
        raise TypeError("has() takes 2 positional arguments but 3 were given")

    by_node["B"].has = has  # type: ignore[method-assign]
    [written], data = persisted(store, rec, tmp_path)
    assert data == committed and written.crc32c == rec.crc32c
