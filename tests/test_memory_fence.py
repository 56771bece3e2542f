"""The memory holders fenced by the writer's token, (claim, save attempt): a job that lost
the folder's lease shares its successor's holders, and a save attempt that was
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

import _mem_nodes
import pytest
import ray
from _mem_nodes import NODES, PATH, fenced, put, three_nodes

from forge_ckpt.errors import CheckpointLockedError
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


def claim(holders: dict[str, Any], number: int, *nodes: str) -> None:
    """The opening of the folder (number, number) claims the holders (all, or those on
    `nodes`) over the claims they serve."""
    for n in nodes or NODES:
        h = holders[n]
        h.configure(h.budget, h.keep, (number, number), h.claim)


def opening(store: Any) -> Identity:
    """A driver's opening of the folder: its claim is newer than any the holders serve."""
    return Identity("run", "fp", "", store.namespace)


def test_a_stale_jobs_late_write_is_refused_by_every_holder(tier):
    """Opening 2 took the folder over; opening 1's rank on another node writes late.
    Unfenced, one holder refused it and another kept it (test_memory_stale_copies.py);
    fenced, every holder refuses it, and any read, verified or not, returns the committed
    bytes. Its removals and pins are refused too: it learns it lost the folder."""
    nodes, store, holders = tier
    claim(holders, 1)
    claim(holders, 2)
    successor, stale = fenced(store, 2, 1), fenced(store, 1, 7)
    committed = os.urandom(200_000)
    successor.fence_step(5)
    put(nodes, successor, "B", committed)
    with pytest.raises(StaleWriteError, match=r"opening of the folder \(1, 1\) is not the one"):
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
    claim(holders, 3)
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
    claim(holders, 1)
    first = fenced(store, 1, 1)
    first.fence_step(5)
    data = os.urandom(10_000)
    put(nodes, first, "A", data)
    first.create("step-5/COMMIT", b"{}")
    with pytest.raises(AlreadyExistsError, match="step 5 is committed here"):
        fenced(store, 1, 2).fence_step(5)
    assert set(copies(holders, PATH).values()) == {data}


def test_an_opening_claims_the_holders_with_a_newer_order_than_they_serve(tier):
    """A driver that opens the folder claims the run's holders with an order newer than any
    claim they serve, and a nonce of its own; from then on every other claim's change is
    refused, before the new driver writes anything. A claim is taken over the one the
    driver saw (compare and set): an opening whose configure lands after a newer one's is
    refused, and is told why."""
    nodes, store, holders = tier
    claim(holders, 4, "A", "B")  # (C was dead or did not answer then)
    first, second = opening(store), opening(store)
    first.start(list(NODES), 1 << 26, 4)
    assert first.claim[0] == 5 and all(h.claim == first.claim for h in holders.values())
    with pytest.raises(StaleWriteError, match=r"opening of the folder \(4, 4\) is not the one"):
        fenced(store, 4, 1).create("step-9/manifest.json", b"{}")
    assert not any(k.startswith("step-9/") for h in holders.values() for k in h.files)
    second.start(list(NODES), 1 << 26, 4)
    assert second.claim[0] == 6
    a = holders["A"]
    with pytest.raises(StaleWriteError, match="another opening of the folder"):
        a.configure(a.budget, a.keep, first.claim, (4, 4))  # the first one's, landing late
    for h in holders.values():  # a driver of an earlier release claims nothing
        assert tuple(h.configure(h.budget, h.keep)["claim"]) == second.claim


def test_holders_of_an_earlier_release_are_still_written(tier, monkeypatch):
    """Holders a driver upgraded within a live run adopts take no token: the changes are
    asked without one (unfenced, as before), not refused with a TypeError."""
    nodes, store, holders = tier
    claim(holders, 2)
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


# ---- reviews 23-26: breaks of earlier versions of the fence, each fixed -------------------
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
    claim(holders, 3)
    with pytest.raises(StaleWriteError, match=r"opening of the folder \(2, 2\) is not the one"):
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
    _mem_nodes.check_arguments_at_submission(monkeypatch)
    nodes, store, holders = tier
    nodes.holders[holder_name("run", "A")] = _EarlierRelease(holders["A"])
    return tier


def test_one_holder_of_an_earlier_release_unfences_only_itself(mixed):
    """The fallback asked every holder again without the token once one took none: a stale
    job's removal then went through on the current holders too, a fence never reached the
    holders listed after the old one, and a rename of this job's own attempt ran twice and
    failed (review 23, claim 2). Only the old holder is asked without the token now."""
    nodes, store, holders = mixed
    claim(holders, 2, "B", "C")
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
    assert all(holders[n].fences[6] == (2, 2, 3) for n in "BC")
    put(nodes, retry, "A", b"metadata", path=tmp)
    retry.rename(tmp, meta)
    assert [n for n in NODES if meta in holders[n].files] and not copies(holders, tmp)


def test_a_holder_started_again_while_the_tier_opens_is_claimed(tier):
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
    identity = opening(store)
    identity.start(list(NODES), 1 << 26, 4)
    assert nodes.holders[name] is not holders["C"]
    assert nodes.holders[name].claim == identity.claim and identity.claim[0] == 1


def test_the_fences_forgotten_first_are_those_set_longest_ago(tier):
    """Past MAX_FENCES a holder forgets the lowest step numbers: after a rollback those are
    the steps being saved, and an aborted attempt's late write then landed (review 23,
    claim 5). It forgets those fenced longest ago now."""
    nodes, store, holders = tier
    claim(holders, 1)
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


def test_a_stale_job_never_shares_its_successors_claim(tier):
    """Compared by lease generation, a job stalled under a lease file deleted by hand (its
    generations restart at 1), or whose holders all died and were started again, was
    "newer" than the lease's holder: its late write landed, raised the holders' floor and
    locked the lease's holder out (reviews 24-26). Claims by order alone collided: an
    opening that saw none of the stale job's holders (retired with a folder made again,
    hung, dead) took the stale job's number, and the two shared the holders (review 27,
    B1, B2). A claim's nonce is its own: any other claim's change is refused."""
    nodes, store, holders = tier
    stale = opening(store)
    stale.start(list(NODES), 1 << 26, 4)
    for h in holders.values():  # all died and were started again (or retired)
        h.claim, h.fences = (0, 0), {}
    successor = opening(store)
    successor.start(list(NODES), 1 << 26, 4)
    assert successor.claim[0] == stale.claim[0] and successor.claim != stale.claim
    put(nodes, fenced(store, successor.claim, 1), "B", b"mine" * 100)
    with pytest.raises(StaleWriteError, match="is not the one this holder serves"):
        put(nodes, fenced(store, stale.claim, 3), "B", b"stale" * 100)
    with pytest.raises(StaleWriteError):
        fenced(store, stale.claim, 4).delete_prefix("step-5")
    assert set(copies(holders, PATH).values()) == {b"mine" * 100}


def test_a_look_for_new_nodes_takes_a_holder_only_under_a_fresh_lease(tier):
    """A look for nodes that joined took or left holders by their claims' orders, which say
    nothing about the lease: a stale job's look took its successor's holders (lower order)
    or killed one (of a folder made again), and the successor never got back a holder of a
    higher order (reviews 25, 28); one holder it could not take stopped the whole look
    (review 27, B3). A look takes any holder, and retires a foreign one, only after the
    folder's lease is checked fresh; a stale job's check fails and it takes nothing."""
    nodes, store, holders = tier

    def lost() -> None:
        raise CheckpointLockedError("lost the lease (test)")

    stale = Identity("run", "fp", "", store.namespace)
    stale.start(["A"], 1 << 26, 4)
    stale.claim, stale.confirm = (9, 9), lost  # it lost the lease; its order is above its
    # successor's (it saw other holders)
    successor = Identity("run", "fp", "", store.namespace, confirm=lambda: None)
    successor.start(["B", "C"], 1 << 26, 4)
    put(nodes, fenced(store, successor.claim, 1), "A", b"committed" * 100)  # on B and C
    with pytest.raises(CheckpointLockedError):
        stale.start(["B", "C"], 1 << 26, 4, joined=True)
    assert holders["B"].claim == holders["C"].claim == successor.claim
    assert PATH in holders["B"].files
    assert [n for _, n in successor.start(["A"], 1 << 26, 4, joined=True)] == ["A"]
    assert holders["A"].claim == successor.claim
    foreign = Identity("run", "fp", "new incarnation", store.namespace, confirm=lost)
    foreign.claim = (1, 1)
    with pytest.raises(CheckpointLockedError):  # a stale job of the folder made before
        foreign.start(["C"], 1 << 26, 4, joined=True)
    assert nodes.holders[holder_name("run", "C")] is holders["C"]


def test_another_openings_attempt_of_a_step_is_no_newer_than_ours(tier):
    """Attempts compared with the claim's nonce in the tuple: a step fenced by another
    opening's attempt 3 refused every attempt of the opening that took the holder over
    (review 28, B2). Another opening's files of the step go as an older attempt's."""
    nodes, store, holders = tier
    claim(holders, 1)
    for h in holders.values():
        h.fences[7] = (1, 1, 3)  # the previous opening's attempt 3 of step 7
    put(nodes, fenced(store, 1, 3), "A", b"theirs", path="step-7/trainer/x")
    for h in holders.values():
        h.configure(h.budget, h.keep, (1, 0), h.claim)  # taken over: the nonce is lower
    mine = fenced(store, (1, 0), 1)
    mine.fence_step(7)
    assert not copies(holders, "step-7/trainer/x")
    put(nodes, mine, "B", b"ours", path="step-7/trainer/x")
    assert set(copies(holders, "step-7/trainer/x").values()) == {b"ours"}


def test_a_holder_taken_by_a_later_look_keeps_nothing_of_another_claim(tier):
    """A holder that did not answer the successor's open kept serving the stale job, whose
    late COMMIT then landed there (its other holders refused it); the successor's later
    look took the holder with the stale step on it, and a reader on that node loaded it
    (review 29, B2). A look that takes a holder from another claim drops its files."""
    nodes, store, holders = tier
    stale = opening(store)
    stale.start(list(NODES), 1 << 26, 4)
    successor = Identity("run", "fp", "", store.namespace, confirm=lambda: None)
    successor.start(["A", "B"], 1 << 26, 4)  # C did not answer
    with pytest.raises(StaleWriteError):  # refused by A and B, lands on C
        fenced(store, stale.claim, 2).create("step-2/COMMIT", b"stale")
    assert [h.files.get("step-2/COMMIT") for h in holders.values()] == [None, None, b"stale"]
    assert [n for _, n in successor.start(["C"], 1 << 26, 4, joined=True)] == ["C"]
    assert not holders["C"].files and holders["C"].claim == successor.claim


def test_a_second_look_of_the_same_opening_keeps_its_committed_pinned_step(tier):
    """Two looks of one opening read a holder's claim while it served the stale job; the
    first took it, a save committed and pinned a step whose only copy is there, then the
    second look's configure wiped it and dropped the pin (review 30, claim 1). A holder that
    serves our claim already is neither wiped nor unpinned."""
    nodes, store, holders = tier
    opening(store).start(list(NODES), 1 << 26, 4)  # the job before claims A, B, C
    succ = Identity("run", "fp", "", store.namespace, confirm=lambda: None)
    succ.start(["A", "B"], 1 << 26, 4)  # C did not answer the opening
    first_look = succ._look(["C"], (1 << 26, 4), 5.0)  # a look reads C's (stale) claim
    assert [n for _, n in succ.start(["C"], 1 << 26, 4, joined=True)] == ["C"]  # another
    mine = fenced(store, succ.claim, 1)
    mine.fence_step(5)
    mine.create("step-5/COMMIT", b"{}")
    mine.fenced("pin", 5, True)
    name, node, seen = first_look[0]
    succ._configure(name, node, (1 << 26, 4), 5.0, (seen, True))  # the first look lands
    assert "step-5/COMMIT" in holders["C"].files and 5 in holders["C"].pinned


def test_a_holder_another_job_started_during_a_look_is_checked_before_it_is_taken(tier):
    """A stale job of the folder's earlier incarnation started a holder on a new node after
    the successor's look found none there; the successor took it without asking whose it
    was, and its next driver retired it with the successor's committed step on it (review
    30, claim 3). A holder found where none was is checked like any other."""
    nodes, store, holders = tier
    name = holder_name("run", "C")
    del nodes.holders[name]  # node C just joined: no holder there yet

    def start_holder(name: str, namespace: str, node: str, *args: Any) -> None:
        nodes.me = node
        nodes.holders[name] = Holder(*args, listen=False)

    def kill(handle: Any) -> None:
        for k, v in list(nodes.holders.items()):
            if v is handle.obj:
                del nodes.holders[k]

    nodes.start_holder, nodes.kill = start_holder, kill  # type: ignore[method-assign]
    nodes.sleep = lambda s: None  # type: ignore[method-assign]
    succ = Identity("run", "fp", "", store.namespace, confirm=lambda: None)
    succ.start(["A", "B"], 1 << 26, 4)
    real, raced = succ._retire_foreign, []

    def a_stale_job_starts_one(name: str, wait_s: float = 60.0) -> Any:
        seen = real(name, wait_s)
        if not raced:  # once: the stale job's look creates its holder, then fails
            raced.append(True)
            start_holder(name, "", "C", "run", "fp", 1 << 26, 4, "old incarnation")
        return seen

    succ._retire_foreign = a_stale_job_starts_one  # type: ignore[method-assign]
    assert [n for _, n in succ.start(["C"], 1 << 26, 4, joined=True)] == ["C"]
    assert nodes.holders[name].incarnation == "" and nodes.holders[name].claim == succ.claim
