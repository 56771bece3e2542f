"""Review 7: the post-commit task (`_follow`) of a save cancelled in its memory commit, and
what escapes the waits of load(), aclose() and a later event loop.

Each test holds a storage call of the driver in its thread with a threading.Event (a slow S3
call, a slow holder) and cancels a save there, as a caller's deadline does. One node's local
Ray; holders keep one copy (`memory_copies=1`).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from _persist_holds import Counter, hold

from forge_ckpt import CheckpointConfig, CheckpointCoordinator
from forge_ckpt.memory.store import MemoryStorage
from forge_ckpt.steps import commit, layout

pytestmark = pytest.mark.asyncio(loop_scope="module")

LATE_S = 5.0  # a hold that only the code under test should end earlier


@pytest.fixture(scope="module")
def counter(ray_local):
    return Counter.remote()


def config(folder: str) -> CheckpointConfig:
    return CheckpointConfig(folder=folder, memory_every=1, durable_every=1, memory_copies=1)


def read_or_none(store: Any, path: str) -> bytes | None:
    try:
        return bytes(store.read(path))
    except OSError:
        return None


async def cancel_in_commit(coord: CheckpointCoordinator, counter: Any, step: int, mp: Any) -> None:
    """save(step) cancelled while its memory commit runs in its thread (which goes on)."""
    entered, go = hold(mp, "commit_step", coord.tier.store, step=step)
    await counter.set.remote(step)
    saving = asyncio.ensure_future(coord.save(step))
    assert await asyncio.to_thread(entered.wait, 300)
    saving.cancel()
    go.set()
    with pytest.raises(asyncio.CancelledError):
        await saving


async def test_load_returns_with_the_persist_a_cancelled_commit_set_going_in_flight(
    counter, tmp_path, monkeypatch
):
    """`_load` settles the tier (`_settle`: the persists in `_chain`) before it waits for the
    cancelled save's follow task (`_quiesce`); that task then starts step 2's persist, which
    the load never waits for: the load (here a rollback to step 1) returns while the old
    branch's step 2 is being persisted into the durable folder, beside the new branch's
    saves. The persist's durable commit is held until the load returned (or LATE_S)."""
    coord = CheckpointCoordinator(config(str(tmp_path / "ckpt")))
    coord.register("counter", counter)
    await counter.set.remote(1)
    await coord.save(1)
    await coord.wait()
    order: list[str] = []
    loaded = threading.Event()
    real = commit.commit_step

    def held(store: Any, manifest: Any, *args: Any) -> Any:
        if store is coord.store and manifest.step == 2:
            loaded.wait(LATE_S)
            order.append("persist of step 2 commits")
        return real(store, manifest, *args)

    monkeypatch.setattr(commit, "commit_step", held)
    await cancel_in_commit(coord, counter, 2, monkeypatch)
    result = await coord.load(step=1)
    order.append("load(step=1) returned")
    in_flight = len(coord.tier._chain)
    loaded.set()
    await coord.wait()
    coord.close()
    assert result is not None and result.step == 1
    assert order[0] == "persist of step 2 commits", f"load returned first: {order}"
    assert in_flight == 0, f"{in_flight} persist(s) still in flight after load() returned"


async def test_the_new_branchs_step_is_the_committed_one_after_a_rollback(
    counter, tmp_path, monkeypatch
):
    """The consequence of the escape above: after load(step=1), the new branch's first save
    of step 2 (durable) and the old branch's persist of step 2 wrote the same folder; the
    persist committed the OLD manifest (recorded in the lease) over the new save's files,
    and a committed step 2 was visible whose files did not match it. The load now waits for
    that persist, so the new branch's step 2 is the committed one, and it verifies. (The
    escape itself, forced by a hold, is the test above; this one guards its outcome.)"""
    coord = CheckpointCoordinator(config(str(tmp_path / "ckpt")))
    coord.register("counter", counter)
    await counter.set.remote(1)
    await coord.save(1)
    await coord.wait()
    await cancel_in_commit(coord, counter, 2, monkeypatch)
    assert (await coord.load(step=1)).step == 1
    await counter.set.remote(20)  # the new branch's step 2 (the old one saved n=2)
    assert (await coord.save(2)).committed
    await coord.wait()
    manifest = layout.read_committed(coord.store, 2)
    sub, bad = coord.store.sub("step-2"), []
    for rec in manifest.files:
        try:
            sub.verify(rec.path, rec)
        except Exception as e:
            bad.append(f"{rec.path}: {e}")
    loaded = await coord.load()
    coord.close()
    assert manifest.supersedes, "the committed step 2 is the old branch's"
    assert not bad, f"committed step 2 does not verify: {bad}"
    assert loaded is not None and loaded.step == 2 and await counter.get.remote() == 20


async def test_a_memory_commit_of_unknown_outcome_that_committed_is_still_persisted(
    counter, tmp_path, monkeypatch
):
    """The follow task runs only for a commit that returned: one that wrote its COMMIT and
    then failed (a lost reply; the save says "outcome unknown") returns None there, so the
    step is never pinned nor persisted, and the timeline never learns it committed. The
    retried save(2) is refused ("already committed; save a different step number", from
    prepare_step) where the protocol says a no-op, and step 2, committed in memory with
    durable_every=1, never becomes durable."""
    coord = CheckpointCoordinator(config(str(tmp_path / "ckpt")))
    coord.register("counter", counter)
    real = commit.commit_step
    failed: list[int] = []

    def lost_reply(store: Any, manifest: Any, *args: Any) -> Any:
        out = real(store, manifest, *args)
        if isinstance(store, MemoryStorage) and manifest.step == 2 and not failed:
            failed.append(2)
            raise OSError("the reply was lost (test)")
        return out

    monkeypatch.setattr(commit, "commit_step", lost_reply)
    for step in (1, 2):
        await counter.set.remote(step)
        try:
            await coord.save(step)
        except Exception as e:
            print(f"save({step}): {e}")
    try:  # the retry of a committed step: a no-op, "already committed" (docs/protocol.md)
        retry: Any = (await coord.save(2)).committed
    except Exception as e:
        retry = e
    await coord.wait()
    durable, in_memory = coord.steps(), coord.tier.steps()
    coord.close()
    print(f"retry: {retry!r}; durable {durable}, memory {in_memory}")
    assert retry is True, f"the retried save(2) of a committed step raised: {retry}"
    assert 2 in durable, f"memory step 2 is committed ({in_memory}) but never persisted"


async def test_the_old_branchs_persist_never_unpins_the_new_branchs_step(
    counter, tmp_path, monkeypatch
):
    """Another consequence of the escape: the old branch's persist of step 3 ran after
    load(step=1); the new branch saved 2 (durable) and 3 (memory, pinned, its persist
    queued behind the old one). The old persist ended (its manifest no longer matched the
    holders' step 3) and unpinned step 3: the NEW step 3, still waiting for its persist.
    With memory_keep=1 the next memory save dropped it, and the new step 3, reported
    committed, was then neither durable nor in memory. The new step 3's persist is held
    at its durable preparation while step 4 is saved (memory retention). (The escape
    itself is the first test of this module; this one guards its outcome.)"""
    coord = CheckpointCoordinator(CheckpointConfig(folder=str(tmp_path / "ckpt"),
                                  memory_every=1, durable_every=1, memory_copies=1,
                                  memory_keep=1, keep_last=None))  # fmt: skip
    coord.register("counter", counter)
    for step in (1, 2):
        await counter.set.remote(step)
        await coord.save(step)
    await coord.wait()
    await cancel_in_commit(coord, counter, 3, monkeypatch)
    assert (await coord.load(step=1)).step == 1  # waits for the old persist of step 3
    entered, go = threading.Event(), threading.Event()
    real = commit.prepare_step

    def held(store: Any, step: int, *args: Any) -> Any:
        if store is coord.store and step == 3 and not entered.is_set():
            entered.set()
            assert go.wait(300)
        return real(store, step, *args)

    monkeypatch.setattr(commit, "prepare_step", held)
    for step in (2, 3):
        await counter.set.remote(step * 10)
        assert (await coord.save(step)).committed
    try:
        assert await asyncio.to_thread(entered.wait, 300)  # the new persist of 3, held
        await counter.set.remote(40)
        await coord.save(4, durable=False)  # memory retention, memory_keep=1
        pinned = 3 in coord.tier._pinned
    finally:
        go.set()
    await coord.wait()
    durable, in_memory = coord.steps(), coord.tier.steps()
    coord.close()
    assert pinned, "the new step 3 was unpinned while its persist waited"
    assert 3 in durable, f"committed step 3 is lost: durable {durable}, memory {in_memory}"
