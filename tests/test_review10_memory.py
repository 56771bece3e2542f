"""Review 10 with the memory tier (the simulation's harness: virtual time, the real tier and
holders): a landed memory save due to be persisted whose reply was lost is owed; a wait()
cancelled while it looked (A), or aclose() raising the save's failure first (C), left it
never pinned nor persisted, and close() took it with the holders (I1).

D: a node that joined later, whose holder never answers, stalled every save that looked for
new nodes (START_TIMEOUT_S, then a call's 60 s) past save_timeout_s, and a healthy node that
joined with it was never used; each new node now gets JOIN_WAIT_S per look, on its own.
D2: an open of the folder beside one of the run's holders that hangs failed with Ray's bare
GetTimeoutError; the tier now goes on without that holder, as if its node were lost.
Review 11, claim 7: an owed memory commit settled after a node joined (the tier's store
object replaced) was taken for a durable one: never pinned nor persisted."""

from __future__ import annotations

import asyncio
import errno
import functools
from typing import Any

import pytest
from _owed_faults import failing_looks
from test_sim_memory import Job, wait_out_the_lease, world  # noqa: F401

from forge_ckpt import CheckpointCoordinator, CheckpointSaveError
from forge_ckpt.coordination import follow_ups
from forge_ckpt.coordination.runtime import Runtime
from forge_ckpt.memory.store import MemoryStorage
from forge_ckpt.sim.loop import SimQueueLock, run_io
from forge_ckpt.sim.memory import SimCluster
from forge_ckpt.steps import commit, layout


def lose_memory_reply(a: Job, monkeypatch: Any, step: int) -> list[list[int]]:
    """`step`'s memory commit lands and its reply is lost (once); the list gets what readers
    counted as it landed."""
    real, seen = commit.commit_step, []

    def reply_lost(store: Any, manifest: Any, *args: Any) -> Any:
        out = real(store, manifest, *args)
        if manifest.step == step and isinstance(store, MemoryStorage) and not seen:
            seen.append(layout.committed_steps(store))
            raise OSError(errno.EIO, "reply lost (test)")
        return out

    monkeypatch.setattr(commit, "commit_step", reply_lost)
    return seen


def owing_memory_step_2(w: Any, monkeypatch: Any) -> tuple[Job, list[list[int]]]:
    """A job whose memory step 1 is persisted and whose step 2 (due to be persisted too)
    landed with its reply lost: owed. Also what readers counted as step 2 landed."""
    a = Job(w, "jobA", durable_every=1)
    assert a.coord.tier is not None and a.run(a.coord.save(1)).committed
    a.run(a.coord.wait())
    seen = lose_memory_reply(a, monkeypatch, 2)
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        a.run(a.coord.save(2))
    return a, seen


def next_job_sees(w: Any) -> tuple[Any, list[int]]:
    """What the next job of the folder loads, and its durable steps."""
    b = Job(w, "jobB")
    got = b.run(b.coord.load())
    durable = b.coord.steps()
    b.coord.close()
    return got, durable


def test_a_cancelled_wait_loses_a_landed_memory_step(world, monkeypatch):  # noqa: F811
    a = Job(world, "jobA", durable_every=1)
    assert a.coord.tier is not None and a.run(a.coord.save(1)).committed
    a.run(a.coord.wait())
    seen = lose_memory_reply(a, monkeypatch, 2)
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        a.run(a.coord.save(2))
    owed = [m.step for m, *_ in a.coord._follow_ups.owed]
    look, tasks = follow_ups.committed_as, []

    def deadline_meanwhile(store: Any, manifest: Any) -> bool:
        tasks[0].cancel()  # the caller's deadline fires while the look runs
        return look(store, manifest)

    monkeypatch.setattr(follow_ups, "committed_as", deadline_meanwhile)
    tasks.append(a.start(a.coord.wait()))
    with pytest.raises(asyncio.CancelledError):
        world.loop.run_until_complete(tasks[0])
    monkeypatch.setattr(follow_ups, "committed_as", look)
    left = [m.step for m, *_ in a.coord._follow_ups.owed]
    a.run(a.coord.aclose())
    world.loop.run_until_complete(asyncio.sleep(1.0))  # the cancelled look's thread ends
    got, durable = next_job_sees(world)
    print(
        f"\ncommitted memory steps as step 2 landed: {seen[0]}; owed {owed}, after the "
        f"cancelled wait() {left}; durable after aclose() {durable}; next job loads "
        f"step {got and got.step}"
    )
    assert 2 in durable, "committed memory step 2 was never persisted and is gone"


def test_aclose_drops_a_landed_memory_step(world, monkeypatch):  # noqa: F811
    a = Job(world, "jobA", durable_every=1, async_mode="deferred")
    assert a.coord.tier is not None
    a.run(a.coord.save(1))
    a.run(a.coord.wait())  # step 1: in memory and persisted
    lost = lose_memory_reply(a, monkeypatch, 2)
    a.run(a.coord.save(2))
    with pytest.raises(CheckpointSaveError, match="outcome is unknown"):
        a.run(a.coord.aclose())
    in_memory = lost[0]
    got, durable = next_job_sees(world)
    print(
        f"\ncommitted memory steps as step 2 landed: {in_memory}; after it, durable {durable}; "
        f"the next job loads step {got and got.step} ({got and got.tier})"
    )
    assert 2 in durable, "committed memory step 2 was never persisted and is gone"


def test_a_holder_that_never_starts_stalls_every_save(world, monkeypatch):  # noqa: F811
    cluster: SimCluster = world.memory
    run_call, hung = cluster.run_call, "nodej001"

    def never_on_the_hung_node(call: Any) -> asyncio.Future:
        if call.holder.node == hung:
            return world.loop.create_future()  # no answer, ever
        return run_call(call)

    monkeypatch.setattr(cluster, "run_call", never_on_the_hung_node)
    a = Job(world, "jobA", save_timeout_s=30.0, load_timeout_s=30.0)
    assert a.run(a.coord.save(1)).committed
    cluster.join_node()  # nodej001: its holder never answers
    cluster.join_node()  # nodej002: a healthy node
    took = []
    for step in (2, 3, 4):
        world.loop.run_until_complete(asyncio.sleep(3.0))  # past NODES_EVERY_S
        t0 = world.clock.now
        assert a.run(a.coord.save(step)).committed
        took.append(round(world.clock.now - t0, 1))
    t0 = world.clock.now
    a.run(a.coord.load())
    load_s = round(world.clock.now - t0, 1)
    nodes = sorted(node for _, node in a.coord.tier.holders)
    a.coord.close()
    print(
        f"\nsync save() took {took} virtual s (save_timeout_s=30); a load {load_s} s; "
        f"holders used: {nodes}"
    )
    assert max(took) <= 30, f"a save took {max(took)} s (save_timeout_s=30)"
    assert "nodej002" in nodes, "the healthy new node's holder is never used"


async def open_in_a_thread(job: Job) -> CheckpointCoordinator:
    """As a driver opens it: the constructor's blocking Ray calls in a (simulated) thread,
    so that they meet the holders' latency and timeouts (the sim's own Job opens inline,
    where every holder call answers at once)."""
    rt = Runtime(to_thread=run_io, wall=job.w.clock.wall, lease_thread=False,
                 identity=job.proc.identity(), lock=SimQueueLock)  # fmt: skip
    job.coord = await run_io(functools.partial(CheckpointCoordinator, job.config, runtime=rt))
    return job.coord


def test_open_with_a_hung_holder(world, monkeypatch):  # noqa: F811
    cluster: SimCluster = world.memory
    a = Job(world, "jobA")
    assert a.run(a.coord.save(1)).committed
    world.kill(a.proc)  # the driver dies; its holders stay
    wait_out_the_lease(world)
    run_call = cluster.run_call

    def hung_on_node1(call: Any) -> asyncio.Future:
        if call.holder.node == "node0001":
            return world.loop.create_future()
        return run_call(call)

    monkeypatch.setattr(cluster, "run_call", hung_on_node1)
    outcomes = []
    for name in ("jobB", "jobC"):
        b = Job(world, name, opened=False)
        t0 = world.clock.now
        try:
            b.run(open_in_a_thread(b))
            outcomes.append(("opened", round(world.clock.now - t0, 1)))
            b.coord.close()
        except BaseException as e:  # noqa: BLE001 (what the opener sees is the point)
            outcomes.append((f"{type(e).__module__}.{type(e).__name__}: {e}",
                             round(world.clock.now - t0, 1)))  # fmt: skip
    print(f"\nopens: {outcomes}")
    assert all(o[0] == "opened" for o in outcomes), outcomes


@pytest.mark.parametrize("join", [False, True], ids=["control-no-join", "a-node-joins"])
def test_an_owed_memory_commit_settled_after_a_node_joined(world, monkeypatch, join):  # noqa: F811
    cluster: SimCluster = world.memory
    a, seen = owing_memory_step_2(world, monkeypatch)
    old_store = a.coord.tier.store
    if join:
        cluster.join_node()  # a replacement node joins
    world.loop.run_until_complete(asyncio.sleep(3.0))  # past NODES_EVERY_S
    failing_looks(monkeypatch, 1)  # save(3)'s look at 2 fails: 2 stays owed
    assert a.run(a.coord.save(3)).committed  # its follow-up finds the new node
    replaced = a.coord.tier.store is not old_store
    a.run(a.coord.wait())  # settles 2: landed
    a.run(a.coord.aclose())
    _, durable = next_job_sees(world)
    print(
        f"\nmemory steps as step 2 landed: {seen[0]}; tier store replaced by the join: "
        f"{replaced}; durable after aclose(): {durable}"
    )
    assert replaced == join, "the join did not replace the store (test broken)"
    assert 2 in durable, "committed memory step 2 (due) was never persisted and is gone"


def test_a_load_that_could_not_look_loads_the_owed_step_and_persists_it(world, monkeypatch):  # noqa: F811
    """Review 11, claim 8: a deciding load whose look at an owed memory commit fails drops
    the entry (it decides from what it reads), then loads that very step: the step is the
    job's present, yet its follow-up (pin, persist: due) never ran, and aclose() took it
    with the holders. The load now runs the follow-up of the commit it loaded."""
    a, seen = owing_memory_step_2(world, monkeypatch)
    failing_looks(monkeypatch, 1)  # the load's look at 2: one read error
    got = a.run(a.coord.load())
    a.run(a.coord.aclose())
    again, durable = next_job_sees(world)
    print(
        f"\nmemory steps as step 2 landed: {seen[0]}; the load -> step {got and got.step} "
        f"({got and got.tier}); durable after aclose(): {durable}; the next job loads "
        f"step {again and again.step}"
    )
    assert got is not None and got.step == 2 and got.tier == "memory"
    assert 2 in durable, "memory step 2, committed, due and loaded, was never persisted"
