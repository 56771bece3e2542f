"""Memory-tier holes the simulation found, each replayed as one scripted schedule without
faults: real coordinators, the real memory tier and `Holder`s behind the simulated Ray seam
(forge_ckpt/sim/memory.py), on virtual time, so that a lease expires without waiting."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import logging
import random
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

pytest.importorskip("greenlet", reason="the simulation needs greenlet (pip install -e '.[sim]')")

from forge_ckpt import CheckpointConfig, CheckpointCoordinator  # noqa: E402
from forge_ckpt.coordination.runtime import Runtime  # noqa: E402
from forge_ckpt.errors import CheckpointError  # noqa: E402
from forge_ckpt.memory import cluster as seam  # noqa: E402
from forge_ckpt.memory import tier as tier_module  # noqa: E402
from forge_ckpt.memory.holder import StaleWriteError  # noqa: E402
from forge_ckpt.memory.holders import Identity  # noqa: E402
from forge_ckpt.sim.actors import Component, SimActor  # noqa: E402
from forge_ckpt.sim.loop import SimQueueLock, SimThread, run_io  # noqa: E402
from forge_ckpt.sim.memory import SimCluster  # noqa: E402
from forge_ckpt.sim.scenario import _hermetic  # noqa: E402
from forge_ckpt.sim.world import PROC, Faults, Proc, World  # noqa: E402
from forge_ckpt.steps import layout  # noqa: E402
from forge_ckpt.storage import open_storage  # noqa: E402
from forge_ckpt.storage.base import StorageError  # noqa: E402

TTL = 30.0


@pytest.fixture
def world(tmp_path, monkeypatch):
    logging.getLogger("forge_ckpt").setLevel(logging.CRITICAL)
    monkeypatch.setenv("FORGE_CKPT_FAULT", "fsync:skip,fsync_dir:skip")
    _hermetic()
    w = World(0, s3=False, root=str(tmp_path), ttl=TTL)
    w.faults = Faults()  # no faults: each test scripts its own schedule
    w.memory = SimCluster(w, random.Random(0), nodes=3)
    w.memory.slow = 0.0
    seam.install(w.memory)
    yield w
    w.loop.close()
    _hermetic()
    logging.getLogger("forge_ckpt").setLevel(logging.NOTSET)


class Job:
    """A driver process with its coordinator and one actor."""

    def __init__(self, world: World, name: str, *, opened: bool = True, **config: Any) -> None:
        """`opened=False`: open it later, from a task of the world's loop (`await _open()`)."""
        self.w, self.proc = world, Proc(name)
        cfg = {"memory_every": 1, "durable_every": 100, "memory_keep": 3, **config}
        self.config = CheckpointConfig(folder=world.folder, lease_ttl_s=TTL, **cfg)
        if opened:
            self.coord: CheckpointCoordinator = self.run(self._open())

    async def _open(self) -> CheckpointCoordinator:
        rt = Runtime(to_thread=run_io, wall=self.w.clock.wall, lease_thread=False,
                     identity=self.proc.identity(), lock=SimQueueLock)  # fmt: skip
        coord = CheckpointCoordinator(self.config, runtime=rt)
        coord.register("c0", SimActor(self.w, Proc(f"{self.proc.name}.a0"), Component("c0")))
        self.coord = coord
        return coord

    def run(self, coro: Coroutine) -> Any:
        """`coro` in this job's process, on the world's virtual time."""
        return self.w.loop.run_until_complete(self.start(coro))

    def start(self, coro: Coroutine) -> asyncio.Task:
        """`coro` as a task of this job's process (runs as the loop runs)."""
        ctx = contextvars.copy_context()
        ctx.run(PROC.set, self.proc)
        return ctx.run(self.w.loop.create_task, coro)


def wait_out_the_lease(world: World) -> None:
    world.loop.run_until_complete(asyncio.sleep(TTL * 1.5))  # virtual seconds


def test_a_job_that_lost_the_lease_leaves_the_holders_to_its_successor(world):
    """Job A stalls past its lease; B takes the folder over and saves step 2 to memory; A
    then closes. A's close() killed the run's holders, and B's committed memory step with
    them (sim seed 216): now A leaves them."""
    a = Job(world, "jobA")
    assert a.run(a.coord.save(1)).committed
    wait_out_the_lease(world)
    b = Job(world, "jobB")
    assert b.run(b.coord.save(2)).committed
    a.coord.close()
    assert b.run(b.coord.load()).step == 2
    assert b.run(b.coord.load()).tier == "memory"
    b.coord.close()


def test_a_rollback_whose_first_save_asks_for_memory_only_is_not_undone_by_a_load(world):
    """Steps 1-3 are durable; load(step=1) rolls back and save(2, durable=False) commits the
    new branch. The driver dies. The next driver's load() resumed durable step 3, of the
    branch the job rolled back from (sim seed 802, when that save went to memory only): a
    new branch's first step is durable now, so it names what it abandons where it outlives
    the driver, and the next load resumes it."""
    a = Job(world, "jobA", durable_every=1)
    for step in (1, 2, 3):
        assert a.run(a.coord.save(step)).committed
    a.run(a.coord.wait())
    assert a.coord.steps() == [1, 2, 3]
    assert a.run(a.coord.load(step=1)).step == 1
    assert a.run(a.coord.save(2, durable=False)).committed
    world.kill(a.proc)  # the driver dies: no close(), its holders live on
    wait_out_the_lease(world)
    b = Job(world, "jobB")
    got = b.run(b.coord.load())
    assert (got.step, got.tier) == (2, "durable")
    assert got.manifest.supersedes  # the new branch's step, not the abandoned step 2
    assert b.coord.steps() == [1, 2]
    b.coord.close()


def test_a_stale_jobs_memory_manifest_does_not_fail_its_successors_save(world):
    """Job A lost the lease; its memory manifest of step 2 lands in B's step 2 after B
    prepared it. B's commit failed as "another writer is committing" (sim seed 216): memory
    commits are fenced by B's lease on the folder, and the leftover is replaced."""
    a = Job(world, "jobA")
    assert a.run(a.coord.save(1)).committed
    wait_out_the_lease(world)
    b = Job(world, "jobB")
    real = b.coord._committer.commit_now

    def stale_write_lands_first(manifest: Any, store: Any) -> None:
        if store is not None and manifest.step == 2:  # the memory commit of step 2
            store.create("step-2/manifest.json", b'{"step": 2, "stale": true}')
        real(manifest, store)

    b.coord._committer.commit_now = stale_write_lands_first  # type: ignore[method-assign]
    assert b.run(b.coord.save(2)).committed
    b.coord._committer.commit_now = real  # type: ignore[method-assign]
    got = b.run(b.coord.load())
    assert (got.step, got.tier) == (2, "memory")
    b.coord.close()


def test_a_stale_jobs_save_leaves_its_successors_step_in_progress(world):
    """Job A stalls past its lease; B takes the folder over and writes memory step 2 (files
    and manifest, no COMMIT yet). A, still running, saves step 2: its preparation took B's
    step for an uncommitted leftover and removed it, then wrote A's own files and manifest;
    B's COMMIT landed on them and B's committed memory step 2 was not whole (sim seed 16233).
    The removal now renews A's lease first: A learns it lost the folder and removes nothing."""
    a, b = stale_and_successor(world)
    stale = before_bs_marker(b, lambda: a.start(_outcome(a.coord.save(2))))
    assert b.run(b.coord.save(2)).committed
    assert "lost the lease" in stale[0].result()
    got = b.run(b.coord.load())
    assert (got.step, got.tier) == (2, "memory")
    b.coord.close()


def test_a_stale_jobs_abort_leaves_its_successors_step_in_progress(world):
    """As above, but A's save of step 2 got past its preparation before B wrote step 2 (no
    leftover yet) and then failed (an actor lost, say): its abort removed the step's files,
    B's by then, and B's committed memory step 2 was not whole. The abort's removal renews
    A's lease first, as a durable one does: A learns it lost the folder and removes nothing."""
    a, b = stale_and_successor(world)
    assert a.coord.tier is not None
    mine = a.coord.tier.store
    aborts = before_bs_marker(b, lambda: a.start(a.coord._committer.discard(2, mine)))
    assert b.run(b.coord.save(2)).committed
    assert aborts[0].done()
    got = b.run(b.coord.load())
    assert (got.step, got.tier) == (2, "memory")
    b.coord.close()


def stale_and_successor(world: World) -> tuple[Job, Job]:
    """A saved step 1 and stalled past its lease (it does not know); B took the folder."""
    a = Job(world, "jobA")
    assert a.run(a.coord.save(1)).committed
    wait_out_the_lease(world)
    return a, Job(world, "jobB")


def before_bs_marker(b: Job, stale: Callable[[], asyncio.Task]) -> list[asyncio.Task]:
    """Once B's memory step 2 has its files and manifest, and before its COMMIT: start
    `stale()` (the stale job's call) and let it run to its end (B's commit waits)."""
    tier = b.coord.tier
    assert tier is not None
    attempt, started = tier.attempt, []

    def hooked(number: int) -> Any:  # the save attempt's storage: its commit's creates
        store, spec = attempt(number)
        create = store.create

        def then_create(path: str, data: Any) -> Any:
            if path == "step-2/COMMIT" and not started:
                started.append(stale())
                thread = SimThread.current()
                assert thread is not None
                thread.wait_until(b.w.loop, started[0], None)
            return create(path, data)

        store.create = then_create  # type: ignore[method-assign]
        return store, spec

    tier.attempt = hooked  # type: ignore[method-assign]
    return started


async def _outcome(save: Coroutine) -> str:
    try:
        return repr(await save)
    except CheckpointError as e:
        return str(e)


def test_a_stale_jobs_memory_retention_removes_none_of_its_successors_steps(world):
    """Job A (memory_keep=1) committed memory step 2 under its lease, then stalled past it
    before its memory retention ran. B took the folder over (it keeps 3 memory steps) and
    saved step 3. A's retention then removed step 1, which B had accepted and still keeps:
    it ran outside the lease, and a memory step's removal checked none. It now runs under
    the lease, and each removal renews it first: A learns it lost the folder, removes
    nothing, and its committed save says so only in the log."""
    a = Job(world, "jobA", memory_keep=1)
    assert a.run(a.coord.save(1)).committed
    assert a.coord.tier is not None
    tier, b = a.coord.tier, Job(world, "jobB", opened=False, memory_keep=3)
    real, started = tier._retention, []

    async def take_over() -> None:  # B, once A's lease has run out
        await asyncio.sleep(TTL * 1.5)  # virtual seconds
        coord = await b._open()
        assert (await coord.save(3)).committed

    def stalled(step: int) -> None:
        if step == 2 and not started:
            started.append(b.start(take_over()))
            thread = SimThread.current()
            assert thread is not None
            thread.wait_until(world.loop, started[0], None)
        real(step)

    tier._retention = stalled  # type: ignore[method-assign]
    assert a.run(a.coord.save(2)).committed
    started[0].result()
    assert b.coord.tier is not None
    assert b.coord.tier.steps() == [1, 2, 3]
    b.coord.close()


def test_each_save_attempt_writes_to_the_holders_with_its_own_token(world, monkeypatch):
    """The coordinator hands every unit its save attempt's memory storage: the folder
    lease's generation and the attempt's number, by which the holders fence a step's files
    (test_memory_fence.py). A successor's holders refuse the stalled job's save at once."""
    seen: list[tuple[int, int]] = []
    real = Component.forge_begin_save

    def spy(self: Component, where: Any, *args: Any) -> dict:
        seen.append(tuple(where.options["fence"]))
        return real(self, where, *args)

    monkeypatch.setattr(Component, "forge_begin_save", spy)
    a, b = stale_and_successor(world)
    assert a.coord.tier is not None and b.coord.tier is not None
    claim_a, claim_b = a.coord.tier.claim, b.coord.tier.claim
    assert claim_b > claim_a and seen and all(t[:2] == claim_a for t in seen)
    assert b.run(b.coord.save(2)).committed and b.run(b.coord.save(3)).committed
    mine = [t for t in seen if t[:2] == claim_b]
    assert len(mine) == 2 and mine[0][2] < mine[1][2]  # one attempt per save, in order
    holders = [h.obj for h in world.memory.actors.values() if h.proc.alive]
    assert all(h.claim == claim_b and h.fences.get(3) == mine[1] for h in holders)
    assert "lease" in a.run(_outcome(a.coord.save(4)))  # refused: it lost the folder
    assert b.run(b.coord.load()).step == 3
    b.coord.close()


def lease_file_deleted_under(world: World, stalled: bool) -> tuple[Job, Job]:
    """Z saved step 1 and died (its holders live on); B (generation 2) saved step 2 and
    died, or stalls alive past its lease (`stalled`). The lease file is deleted, as
    docs/format.md says to do while no job runs (an expired lease looks just like that),
    and C opens the folder: its lease starts again at generation 1. (B, C)"""
    z = Job(world, "jobZ")
    assert z.run(z.coord.save(1)).committed
    world.kill(z.proc)
    wait_out_the_lease(world)
    b = Job(world, "jobB")
    assert b.coord._lease.generation == 2 and b.run(b.coord.save(2)).committed
    if not stalled:
        world.kill(b.proc)
    wait_out_the_lease(world)
    open_storage(world.folder).delete(layout.LEASE)
    return b, Job(world, "jobC")


def test_a_driver_opens_the_folder_after_its_lease_file_was_deleted(world):
    """The run's holders remembered generation 2 and refused the next driver's generation 1:
    it could not open, told it had lost the lease it held (review 23, claim 3). The holders
    are claimed by each opening of the folder, whatever the lease's generation."""
    b, c = lease_file_deleted_under(world, stalled=False)
    assert c.coord._lease.generation == 1
    assert c.coord.tier is not None and b.coord.tier is not None
    assert c.coord.tier.claim > b.coord.tier.claim
    got = c.run(c.coord.load())
    assert (got.step, got.tier) == (2, "memory")
    assert c.run(c.coord.save(3)).committed
    c.coord.close()


def test_a_job_stalled_under_a_deleted_lease_file_stays_fenced_off(world):
    """B stalled alive under the deleted lease file: its save, and a late write of one of
    its ranks, landed on C's holders once they had been reset to C's generation 1, raised
    their floor back to 2, and every save of C, which holds the lease, was then refused as
    "lost the lease" (review 24, B1); with the holders' floor raised past it instead, its
    write still landed on holders that did not remember its generation (review 25, B1).
    Each opening of the folder claims the holders; no other claim's change is taken."""
    b, c = lease_file_deleted_under(world, stalled=True)
    assert c.run(c.coord.save(3)).committed
    assert "lease" in b.run(_outcome(b.coord.save(4)))
    store, _ = b.coord.tier.attempt(99)  # one of B's ranks, writing late
    with pytest.raises(StaleWriteError):
        with store.writer("step-6/trainer/late.distcp", exclusive=True) as w:
            w.write(b"stale" * 100)
            w.close()
    holders = [h.obj for h in world.memory.actors.values() if h.proc.alive]
    assert not [k for h in holders for k in h.files if k.startswith(("step-4/", "step-6/"))]
    for step in (5, 6):
        assert c.run(c.coord.save(step)).committed
    c.coord.close()


def test_an_opening_that_stalls_past_its_lease_takes_none_of_its_successors_holders(
    world, monkeypatch
):
    """Job A took the lease and stalled while its memory tier opened, past the TTL; B took
    the folder over and claimed the holders; A's opening then claimed them over B's claim,
    and every save of B, which holds the lease, was refused (review 29, B1). An opening
    claims a holder only after a fresh check of the lease: A's open fails, B saves."""
    a, b = Job(world, "jobA", opened=False), Job(world, "jobB", opened=False)
    real, stalled = tier_module.incarnation, []

    def stall(durable: Any) -> Any:
        inc = real(durable)
        if not stalled:  # A: lease taken, folder cleaned; it stalls past its TTL here
            stalled.append(True)
            world.clock.now += TTL * 1.5
            ctx = contextvars.copy_context()
            ctx.run(PROC.set, b.proc)
            with contextlib.suppress(StopIteration):  # B opens (inline holder calls)
                ctx.run(b._open().send, None)
        return inc

    monkeypatch.setattr(tier_module, "incarnation", stall)
    with pytest.raises(CheckpointError, match="lease"):
        a.run(a._open())
    assert b.coord._lease.held and b.coord.tier is not None
    assert b.run(b.coord.save(2)).committed
    holders = [h.obj for h in world.memory.actors.values() if h.proc.alive]
    assert all(h.claim == b.coord.tier.claim for h in holders)
    b.coord.close()


def test_a_lease_check_that_fails_while_the_tier_opens_says_so_and_releases_it(world, monkeypatch):
    """The opening checks the folder's lease before it claims the holders; a storage error
    there escaped the coordinator as the bare lease error, which spoke of a removal (review
    30, claim 2). It says the holders could not be claimed and what to do; the lease is
    released, and the next job opens at once."""
    real = Identity._confirm_take

    def storage_down(self: Identity, seen: Any) -> None:
        self.confirm = _failing_check
        real(self, seen)

    monkeypatch.setattr(Identity, "_confirm_take", storage_down)
    with pytest.raises(CheckpointError, match="could not be checked before claiming"):
        Job(world, "jobA")
    monkeypatch.setattr(Identity, "_confirm_take", real)
    Job(world, "jobB").coord.close()


def _failing_check() -> None:
    raise StorageError(errno.EIO, ".forge_ckpt.lease: 503 Slow Down (test)")
