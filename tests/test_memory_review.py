"""The memory tier's holes that review 3 found. With a rollback (`load(step=K)` with newer
steps) there were five ways to lose a committed step or resume the abandoned branch (claims
1, 2, 7, 8, 9); and a persist's durable commit held up every memory save. The rule now: the first step of a new branch is saved to the durable folder (whatever `durable`
says), its manifest names every step it abandons in both tiers, abandoned memory steps are
removed once it has committed and skipped by every load meanwhile, and one coordinator runs
one save or load at a time; a memory commit never waits for a durable one.

One node's local Ray; holders keep one copy (`memory_copies=1`).
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from _persist_holds import Counter, cancel_once_pinned, hold

from forge_ckpt import CheckpointConfig, CheckpointCoordinator, CheckpointSaveError
from forge_ckpt.steps import layout

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def counter(ray_local):
    return Counter.remote()


def config(folder: str, durable_every: int, memory_keep: int = 3) -> CheckpointConfig:
    return CheckpointConfig(folder=folder, memory_every=1, durable_every=durable_every,
                            memory_copies=1, memory_keep=memory_keep)  # fmt: skip


async def saved(coord: CheckpointCoordinator, counter, steps, **kw) -> None:
    for step in steps:
        await counter.set.remote(step)
        await coord.save(step, **kw)


class Crash(BaseException):
    """The driver dies here."""


async def test_a_branch_that_starts_memory_only_is_durable_and_never_resumes_the_old_one(
    counter, tmp_path
):
    """Claims 1 and 2: a branch's first save with durable=False left no durable record of
    the abandonment; the old durable step 5 was loaded, and the new step 5 (durable=True)
    was never persisted ('already committed')."""
    folder = str(tmp_path / "ckpt")
    coord = CheckpointCoordinator(config(folder, durable_every=1, memory_keep=2))
    coord.register("counter", counter)
    await saved(coord, counter, range(1, 6))
    await coord.wait()
    assert (await coord.load(step=3)).step == 3
    await counter.set.remote(400)
    first = await coord.save(4, durable=False)
    assert first.path.startswith(folder) and coord.steps() == [3, 4]  # durable; 5 retired
    assert all(s <= 3 for s in coord.tier.steps())  # the old branch's memory steps: gone
    assert (await coord.load()).step == 4 and await counter.get.remote() == 400
    await counter.set.remote(500)
    await coord.save(5, durable=True)
    await coord.aclose()
    durable_only = CheckpointCoordinator(CheckpointConfig(folder=folder))
    durable_only.register("counter", counter)
    assert (await durable_only.load()).step == 5 and await counter.get.remote() == 500
    durable_only.close()


async def test_a_driver_dead_before_removing_the_old_memory_steps_resumes_the_new_branch(
    counter, tmp_path
):
    """Claim 7: the driver died between the new branch's commit and the removal of the
    abandoned memory steps; the next driver loaded the abandoned memory step 5."""
    folder = str(tmp_path / "ckpt")
    a = CheckpointCoordinator(config(folder, durable_every=100))
    a.register("counter", counter)
    await saved(a, counter, range(1, 6))  # memory only: durable_every=100
    assert (await a.load(step=3)).step == 3
    await counter.set.remote(400)

    async def die() -> None:
        raise Crash("driver killed after the new branch's commit")

    a._committer.retire_memory = die  # type: ignore[method-assign]
    with pytest.raises(Crash):
        await a.save(4)
    a._lease.release()  # the dead driver's lease expires; its holders live on
    b = CheckpointCoordinator(config(folder, durable_every=100))
    b.register("counter", counter)
    assert b.tier.steps() == [3, 4, 5] and b.steps() == [4]
    loaded = await b.load()
    assert (loaded.step, loaded.tier, await counter.get.remote()) == (4, "durable", 400)
    assert b.tier.steps() == [3]  # the abandoned ones were removed before the load chose
    b.close()


async def test_a_failed_first_save_of_a_branch_loses_no_memory_step(counter, tmp_path):
    """Claim 8: the branch's first save removed the old memory step 4 (its only copy) before
    the save failed, and the error said that nothing was ever committed."""
    folder = str(tmp_path / "ckpt")
    coord = CheckpointCoordinator(config(folder, durable_every=100))
    coord.register("counter", counter)
    await saved(coord, counter, range(1, 6))
    assert (await coord.load(step=3)).step == 3
    await counter.set.remote(400, True)  # its snapshot raises
    with pytest.raises(CheckpointSaveError, match="step 5 is still the newest") as e:
        await coord.save(4)
    assert "no committed step" not in str(e.value)
    assert coord.tier.steps() == [3, 4, 5] and coord.steps() == []
    await counter.set.remote(5)
    assert (await coord.load()).step == 5  # the load is no rollback: the old branch stays
    coord.close()


async def test_a_load_during_a_save_waits_for_it(counter, tmp_path):
    """Claim 9: load(step=2) ran while save(5) was committing; the rollback point it set
    made save(5) remove memory steps 3 and 4, which no committed branch had abandoned."""
    folder = str(tmp_path / "ckpt")
    coord = CheckpointCoordinator(config(folder, durable_every=100, memory_keep=4))
    coord.register("counter", counter)
    await saved(coord, counter, range(1, 5))
    entered, go = threading.Event(), threading.Event()
    real = coord._committer.commit

    def held_commit(manifest, store=None):  # the commit's thread waits here
        entered.set()
        assert go.wait(120)
        return real(manifest, store)

    coord._committer.commit = held_commit  # type: ignore[method-assign]
    await counter.set.remote(5)
    saving = asyncio.ensure_future(coord.save(5))
    assert await asyncio.to_thread(entered.wait, 120)
    loading = asyncio.ensure_future(coord.load(step=2))
    for _ in range(20):  # let the load run as far as it can: it waits for the save
        await asyncio.sleep(0)
    assert not loading.done()
    go.set()
    assert (await saving).committed and (await loading).step == 2
    assert coord.tier.steps() == [2, 3, 4, 5]  # memory_keep=4: nothing else removed
    assert layout.read_committed(coord.tier.store, 5).supersedes == []
    coord.close()


async def test_a_slow_persist_never_holds_up_a_memory_save(counter, tmp_path, monkeypatch):
    """Review 3 (suspicion, issue 22 item 12): the persist's durable commit (three S3 calls,
    each up to the call bound) held the coordinator's one commit lock, and a memory save's
    commit waited for it. Here the persist of step 2 is held at its durable commit until the
    memory save of step 3 has committed."""
    folder = str(tmp_path / "ckpt")
    coord = CheckpointCoordinator(config(folder, durable_every=2))
    coord.register("counter", counter)
    entered, go = hold(monkeypatch, "commit_step", coord.store)
    await saved(coord, counter, (1, 2))  # step 2 is due: persisted in the background
    assert await asyncio.to_thread(entered.wait, 120)
    try:
        await counter.set.remote(3)
        result = await asyncio.wait_for(coord.save(3), 120)  # memory only: not due
        assert result.committed and 3 in coord.tier.steps() and coord.steps() == []
    finally:
        go.set()
    await coord.wait()
    assert coord.steps() == [2]
    coord.close()


async def test_a_cancelled_wait_still_leaves_the_persist_to_the_next_wait(
    counter, tmp_path, monkeypatch
):
    """A caller's deadline on `wait()` cancelled it while the persist ran; the tier forgot
    the persist in flight, so the next `wait()` returned at once with the step not durable
    (and `close()` could not stop it)."""
    folder = str(tmp_path / "ckpt")
    coord = CheckpointCoordinator(config(folder, durable_every=2))
    coord.register("counter", counter)
    entered, go = hold(monkeypatch, "commit_step", coord.store)
    await saved(coord, counter, (1, 2))  # step 2 is due: persisted in the background
    assert await asyncio.to_thread(entered.wait, 120)
    try:
        first = asyncio.ensure_future(coord.wait())
        for _ in range(20):
            await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        second = asyncio.ensure_future(coord.wait())
        for _ in range(20):  # it must wait for the persist that is still held
            await asyncio.sleep(0)
        assert not second.done() and coord.steps() == []
    finally:
        go.set()
    await second
    assert coord.steps() == [2]
    coord.close()


async def test_a_persist_call_in_flight_never_holds_up_a_memory_save(
    counter, tmp_path, monkeypatch
):
    """Every save first waits for the storage calls of a cancelled save or load to end
    (`_quiesce`); the persist's own durable calls were counted among them, so a memory save
    waited for a persist's `prepare_step` (on S3, up to the call bound)."""
    folder = str(tmp_path / "ckpt")
    coord = CheckpointCoordinator(config(folder, durable_every=2))
    coord.register("counter", counter)
    entered, go = hold(monkeypatch, "prepare_step", coord.store)
    await saved(coord, counter, (1, 2))  # step 2 is due: persisted in the background
    assert await asyncio.to_thread(entered.wait, 120)
    try:
        await counter.set.remote(3)
        result = await asyncio.wait_for(coord.save(3), 120)  # memory only: not due
        assert result.committed and 3 in coord.tier.steps() and coord.steps() == []
    finally:
        go.set()
    await coord.wait()
    assert coord.steps() == [2]
    coord.close()


async def test_a_save_cancelled_behind_the_previous_persist_still_persists_its_step(
    counter, tmp_path, monkeypatch
):
    """Sim seed 1442: a save due for the durable folder pinned its committed memory step,
    then waited for the previous persist, and was cancelled there (a caller's deadline). No
    persist ever started for it: the step stayed pinned (kept out of memory retention) and
    never became durable."""
    folder = str(tmp_path / "ckpt")
    coord = CheckpointCoordinator(config(folder, durable_every=1))
    coord.register("counter", counter)
    entered, go = hold(monkeypatch, "commit_step", coord.store, step=1)
    await saved(coord, counter, (1,))
    assert await asyncio.to_thread(entered.wait, 120)
    try:
        await cancel_once_pinned(coord, counter, 2)  # committed in memory, pinned, waiting
    finally:
        go.set()
    await coord.wait()
    assert coord.steps() == [1, 2] and 2 not in coord.tier._pinned
    coord.close()
