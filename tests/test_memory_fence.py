"""The memory holders fenced by the writer's token, (lease generation, save attempt): a job
that lost the folder's lease shares its successor's holders, and a save attempt that was
aborted may still have a write on its way (a trainer rank's DCP `.metadata`, whose bytes
differ per attempt). Before the fence, such a late write landed on a holder that kept no
file of that name (review 21), where an unverified read could return it, and an earlier
attempt's late `.metadata` failed its own retry as "another writer" (review 22's open item).

Real `Holder` objects with their real listeners, one per simulated node (`_mem_nodes.py`).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from typing import Any

import _mem_nodes
import pytest
import ray
from _mem_nodes import NODES, PATH, fenced, put, three_nodes

from forge_ckpt.memory.holder import MAX_FENCES, Holder, StaleWriteError
from forge_ckpt.memory.holders import Identity
from forge_ckpt.memory.placement import holder_name
from forge_ckpt.memory.writer import STREAM_MIN
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
    with pytest.raises(
        StaleWriteError,
        match="generation 1 of the lease file made at 0.000, older than generation 2",
    ):
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
    with pytest.raises(StaleWriteError, match="save attempt 1 of step 5, which is attempt 2's now"):
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
        h.configure(h.budget, h.keep, (0.0, 4))
    with pytest.raises(
        StaleWriteError,
        match="generation 3 of the lease file made at 0.000, older than generation 4",
    ):
        fenced(store, 3, 1).create("step-9/manifest.json", b"{}")
    assert not any(k.startswith("step-9/") for h in holders.values() for k in h.files)
    for h in holders.values():  # a driver of an earlier release configures no generation
        assert h.configure(h.budget, h.keep)["floor"] == [0.0, 4]


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


# ---- review 23: breaks of the first version of the fence, each fixed ----------------------
BIG = STREAM_MIN + 4096  # a file announced this large is streamed as it is written


def streamed(nodes: Any, store: Any, node: str, path: str, data: bytes) -> None:
    """What a snapshot's write does: create-only, size announced, streamed to holders."""
    nodes.me = node
    with store.writer(path, exclusive=True) as w:
        w.size_hint(len(data))
        w.write(data)
        w.close()


def test_a_streamed_file_carries_the_token_too(tier):
    """A file of 4 MiB or more streams to its holders as it is written; its record, sent at
    the end, carried no token, so a stale job's or an earlier attempt's late file landed,
    and an earlier attempt's late rank file then failed the retry's own as "another
    writer" (review 23, claim 1)."""
    nodes, store, holders = tier
    for h in holders.values():
        h.configure(h.budget, h.keep, (0.0, 3))
    with pytest.raises(
        StaleWriteError,
        match="generation 2 of the lease file made at 0.000, older than generation 3",
    ):
        streamed(nodes, fenced(store, 2, 7), "C", "step-6/actors/a.0.g2s7.msgpack", b"s" * BIG)
    assert not any(k.startswith("step-6/") for h in holders.values() for k in h.files)
    rank, first, retry = "step-5/trainer/rank-0.msgpack", fenced(store, 3, 1), fenced(store, 3, 2)
    first.fence_step(5)
    retry.fence_step(5)
    with pytest.raises(StaleWriteError, match="save attempt 1 of step 5"):
        streamed(nodes, first, "A", rank, b"1" * BIG)
    streamed(nodes, retry, "A", rank, b"2" * BIG)
    assert set(copies(holders, rank).values()) == {b"2" * BIG}


class _EarlierRelease:
    """A holder of the earlier release: the same table; no token arguments, no `fence`."""

    def __init__(self, h: Holder) -> None:
        self._h = h

    def __getattr__(self, name: str) -> Any:
        if name == "fence":
            raise AttributeError(name)
        return getattr(self._h, name)

    def create(self, key: str, data: bytes, overwrite: bool = False) -> bool:
        return self._h.create(key, data, overwrite)

    def delete_prefix(self, prefix: str) -> None:
        self._h.delete_prefix(prefix)

    def rename(self, src: str, dst: str) -> bool:
        return self._h.rename(src, dst)


@pytest.fixture
def mixed(tier, monkeypatch):
    """Node A's holder is of the earlier release; calls are checked as they are submitted,
    as Ray does (a missing method: AttributeError; arguments that do not bind: TypeError)."""
    real = _mem_nodes._Method.remote

    def ray_like(self: Any, *args: Any) -> Any:
        inspect.signature(getattr(self.obj, self.name)).bind(*args)
        return real(self, *args)

    monkeypatch.setattr(_mem_nodes._Method, "remote", ray_like)
    nodes, store, holders = tier
    nodes.holders[holder_name("run", "A")] = _EarlierRelease(holders["A"])
    return tier


def test_one_holder_of_an_earlier_release_unfences_only_itself(mixed):
    """The fallback asked every holder again without the token once one took none: a stale
    job's removal then went through on the current holders too, a fence never reached the
    holders listed after the old one, and a rename of this job's own attempt ran twice and
    failed (review 23, claim 2). Only the old holder is asked without the token now."""
    nodes, store, holders = mixed
    for n in "BC":
        holders[n].configure(holders[n].budget, holders[n].keep, (0.0, 2))
    job = fenced(store, 2, 1)
    job.fence_step(5)
    put(nodes, job, "A", b"committed" * 1000)
    job.create("step-5/COMMIT", b"{}")
    with pytest.raises(StaleWriteError):
        fenced(store, 1, 4).delete_prefix("step-5")
    assert all(PATH in holders[n].files for n in "BC")
    retry, tmp, meta = fenced(store, 2, 3), "step-6/trainer/.metadata.tmp", "step-6/.metadata"
    fenced(store, 2, 2).fence_step(6)
    retry.fence_step(6)
    assert all(holders[n].fences[6] == (0.0, 2, 3) for n in "BC")
    put(nodes, retry, "A", b"metadata", path=tmp)
    retry.rename(tmp, meta)
    assert [n for n in NODES if meta in holders[n].files] and not copies(holders, tmp)


def test_a_holder_started_again_while_the_tier_opens_is_fenced(tier):
    """The holder found on a node died before its configure(): the one started in its place
    was never configured, and a stale job's write landed there (review 23, claim 4)."""
    nodes, store, holders = tier
    name = holder_name("run", "C")

    class Dying(Holder):
        def configure(self, *args: Any) -> dict[str, Any]:
            del nodes.holders[name]  # its process is gone, its name released
            raise ray.exceptions.RayActorError()

    def start_holder(name: str, namespace: str, node: str, *args: Any) -> None:
        nodes.me = node
        nodes.holders[name] = Holder(*args, listen=False)

    nodes.start_holder = start_holder  # type: ignore[method-assign]
    nodes.me = "C"
    nodes.holders[name] = Dying("run", "fp", budget=1 << 26, keep=4, listen=False)
    Identity("run", "fp", "", store.namespace, _Lease(2)).start(list(NODES), 1 << 26, 4)
    assert nodes.holders[name] is not holders["C"] and nodes.holders[name].floor == (0.0, 2)


def test_the_fences_forgotten_first_are_those_set_longest_ago(tier):
    """Past MAX_FENCES a holder forgets the lowest step numbers: after a rollback those are
    the steps being saved, and an aborted attempt's late write then landed (review 23,
    claim 5). It forgets those fenced longest ago now."""
    nodes, store, holders = tier
    job = fenced(store, 1, 1)
    for s in range(1000, 1000 + MAX_FENCES - 1):  # the abandoned branch's steps
        job.fence_step(s)
    first, retry = fenced(store, 1, 9), fenced(store, 1, 10)
    first.fence_step(6)  # the rollback's step 6: attempt 9 aborted, a write on its way
    retry.fence_step(6)
    retry.delete_prefix("step-6")  # attempt 10 aborted too
    fenced(store, 1, 11).fence_step(7)  # past MAX_FENCES: half are forgotten
    with pytest.raises(StaleWriteError):
        put(nodes, first, "A", b"attempt 9, late", path="step-6/trainer/.metadata")


class _Lease:
    """The folder's lease as the holders' `Identity` uses it: (epoch, generation), held."""

    def __init__(self, generation: int, epoch: float = 0.0) -> None:
        self.fence_token = (epoch, generation)


def test_a_lease_file_made_anew_outranks_every_generation_of_the_one_before(tier):
    """A lease file deleted by hand (docs/format.md) restarts its generations at 1. Compared
    by generation alone, a job stalled under the old file (generation 2) was newer than the
    new file's job (generation 1): its late write landed on the new job's holders, raised
    their floor and locked the lease's holder out, while resetting the floor let the
    stalled job in (reviews 24, 25). The epoch, the time the lease file was first made,
    orders them; a holder that was hung while the tier opened is configured as any other."""
    nodes, store, holders = tier
    for h in holders.values():
        h.configure(h.budget, h.keep, (100.0, 5))  # the old lease file's job (generation 5)
    identity = Identity("run", "fp", "", store.namespace, _Lease(1, epoch=200.0))
    assert [n for _, n in identity.start(list(NODES), 1 << 26, 4)] == list(NODES)
    assert all(h.floor == (200.0, 1) for h in holders.values())
    with pytest.raises(StaleWriteError, match="generation 5 of the lease file made at 100"):
        put(nodes, fenced(store, 5, 3, epoch=100.0), "B", b"stale" * 100)
    put(nodes, fenced(store, 1, 1, epoch=200.0), "B", b"mine" * 100)
    assert set(copies(holders, PATH).values()) == {b"mine" * 100}


def test_a_stale_jobs_look_for_new_nodes_leaves_its_successors_holder_alone(tier):
    """A job that lost the lease, looking for nodes that joined, finds its successor's
    holder there: it is refused, and the holder and its steps stay (review 25, B2: the look
    took the refusal for a holder of a lease file made anew, and started it again)."""
    nodes, store, holders = tier
    for h in holders.values():
        h.configure(h.budget, h.keep, (100.0, 2))
    put(nodes, fenced(store, 2, 1, epoch=100.0), "A", b"committed" * 100)
    stale = Identity("run", "fp", "", store.namespace, _Lease(1, epoch=100.0))
    with pytest.raises(StaleWriteError, match="this job lost the folder's lease"):
        stale.start(["C"], 1 << 26, 4, joined=True)
    assert nodes.holders[holder_name("run", "C")] is holders["C"]
    assert PATH in holders["C"].files
