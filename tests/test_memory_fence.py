"""The memory holders fenced by the writer's token, (lease generation, save attempt): a job
that lost the folder's lease shares its successor's holders, and a save attempt that was
aborted may still have a write on its way (a trainer rank's DCP `.metadata`, whose bytes
differ per attempt). Before the fence, such a late write landed on a holder that kept no
file of that name (review 21), where an unverified read could return it, and an earlier
attempt's late `.metadata` failed its own retry as "another writer" (review 22's open item).

Real `Holder` objects with their real listeners, one per simulated node (`_mem_nodes.py`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from _mem_nodes import NODES, PATH, fenced, put, three_nodes

from forge_ckpt.memory.holder import StaleWriteError
from forge_ckpt.storage.base import AlreadyExistsError


@pytest.fixture
def tier() -> Iterator[Any]:
    with three_nodes() as t:
        yield t


META = "step-5/trainer/.metadata"


def copies(holders: dict[str, Any], path: str) -> dict[str, bytes]:
    return {n: bytes(h.files[path]) for n, h in holders.items() if path in h.files}


def test_a_stale_jobs_late_write_is_refused_by_every_holder(tier):
    """Generation 2 took the folder over; generation 1's rank on another node writes late.
    Unfenced, one holder refused it and another kept it (test_memory_stale_copies.py);
    fenced, every holder refuses it, and any read, verified or not, returns the committed
    bytes. Its removals and pins are refused too: it learns it lost the folder."""
    nodes, store, holders = tier
    successor, stale = fenced(store, 2, 1), fenced(store, 1, 7)
    committed = os.urandom(200_000)
    successor.fence_step(5)
    put(nodes, successor, "B", committed)
    with pytest.raises(StaleWriteError, match="lease generation 1 is older than 2"):
        put(nodes, stale, "C", os.urandom(200_000))
    assert set(copies(holders, PATH).values()) == {committed}
    for n in NODES:
        nodes.me = n
        assert bytes(successor.read(PATH)) == committed, n  # unverified: no record to check
    with pytest.raises(StaleWriteError):  # a step the successor has not touched: refused too
        put(nodes, stale, "C", b"x" * 1000, path="step-6/trainer/__0_0.distcp")
    assert not any("step-6/trainer/__0_0.distcp" in h.files for h in holders.values())
    for change in (lambda: stale.delete_prefix("step-5"), lambda: stale.fenced("pin", 5, False)):
        with pytest.raises(StaleWriteError):
            change()
    assert set(copies(holders, PATH).values()) == {committed}


def test_an_earlier_attempts_late_write_neither_lands_nor_fails_the_retry(tier):
    """Attempt 1 of step 5 was aborted with a `.metadata` write on its way. Attempt 2
    prepares the step: attempt 1's files of it go on every holder. Its late `.metadata`,
    landing after, is refused; its late removal (the abort's) leaves attempt 2's files; and
    attempt 2's own `.metadata`, other bytes under the same name, is written."""
    nodes, store, holders = tier
    first, retry = fenced(store, 3, 1), fenced(store, 3, 2)
    first.fence_step(5)
    put(nodes, first, "A", b"attempt 1 data" * 100)
    put(nodes, first, "A", b"attempt 1 metadata", path=META)  # landed before the retry
    retry.fence_step(5)
    assert not any(k.startswith("step-5/") for h in holders.values() for k in h.files)
    mine = os.urandom(50_000)
    put(nodes, retry, "B", mine)
    with pytest.raises(StaleWriteError, match=r"save attempt \(3, 1\) of step 5"):
        put(nodes, first, "C", b"attempt 1 metadata, late", path=META)
    first.delete_prefix("step-5")  # the first attempt's abort, late: skipped, no error
    put(nodes, retry, "C", b"attempt 2 metadata", path=META)
    assert set(copies(holders, META).values()) == {b"attempt 2 metadata"}
    assert set(copies(holders, PATH).values()) == {mine}
    retry.delete_prefix("step-5")  # the retry's own abort does remove its files
    assert not any(k.startswith("step-5/") for h in holders.values() for k in h.files)


def test_a_newer_attempt_never_drops_a_committed_step(tier):
    """A committed step is never an older attempt's leftover: fencing it is refused and its
    files stay (a save of a committed step number is refused before, by prepare_step)."""
    nodes, store, holders = tier
    first = fenced(store, 1, 1)
    first.fence_step(5)
    data = os.urandom(10_000)
    put(nodes, first, "A", data)
    first.create("step-5/COMMIT", b"{}")
    with pytest.raises(AlreadyExistsError, match="step 5 is committed here"):
        fenced(store, 1, 2).fence_step(5)
    assert set(copies(holders, PATH).values()) == {data}


def test_the_generation_is_the_holders_floor_from_configure_on(tier):
    """A driver that opens the tier configures the holders with its lease generation: from
    then on an older job's writes are refused, before it writes anything itself."""
    nodes, store, holders = tier
    for h in holders.values():
        h.configure(h.budget, h.keep, 4)
    with pytest.raises(StaleWriteError, match="generation 3 is older than 4"):
        fenced(store, 3, 1).create("step-9/manifest.json", b"{}")
    assert not any(k.startswith("step-9/") for h in holders.values() for k in h.files)
    for h in holders.values():  # a driver of an earlier release configures no generation
        assert h.configure(h.budget, h.keep)["floor"] == 4


def test_holders_of_an_earlier_release_are_still_written(tier, monkeypatch):
    """Holders a driver upgraded within a live run adopts take no token: the changes are
    asked without one (unfenced, as before), not refused with a TypeError."""
    nodes, store, holders = tier
    for h in holders.values():
        monkeypatch.setattr(h, "create", _untokened(h))
    assert fenced(store, 2, 1).create("step-1/COMMIT", b"{}")
    assert all("step-1/COMMIT" in h.files for h in holders.values())


def _untokened(h: Any) -> Any:
    def create(key: str, data: bytes, overwrite: bool = False) -> bool:  # the old signature
        if key in h.files and not overwrite:
            return False
        h.files[key] = bytes(data)
        return True

    return create
