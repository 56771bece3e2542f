"""One seeded schedule: jobs that save, roll back, register and close at random moments,
killed at random moments, with a successor taking over the folder, all on one world.

Each job is what a user's main script does (open the coordinator, register its actors,
`load()`, then a loop of train-and-save), driven by the real `CheckpointCoordinator`; the
oracle (invariants.py) checks the promises after every call and at the end.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import tempfile
from dataclasses import dataclass
from typing import Literal

from ..config import CheckpointConfig
from ..coordination.coordinator import CheckpointCoordinator
from ..coordination.runtime import Runtime
from ..errors import CheckpointError, CheckpointLockedError
from ..steps import layout, lock
from ..storage import Storage, open_storage
from . import memory as simmem
from .actors import Component, SimActor
from .invariants import Oracle, Violation
from .loop import Crash, Deadlock, SimLock, SimQueueLock, poll, run_io
from .world import PROC, Proc, Trace, World

TTL = 30.0
OPEN_TRIES = 20  # consecutive failed opens that count as never
CHECK_FILES = os.environ.get("FORGE_SIM_CHECK_FILES", "1") == "1"  # verify data at the end
CANCEL_SAVES = float(os.environ.get("FORGE_SIM_CANCEL_SAVES", "0.1"))  # share of saves cancelled


@dataclass
class Outcome:
    seed: int
    violation: str | None
    events: Trace
    s3: bool

    @property
    def trace(self) -> list[str]:
        return self.events.lines()


class Job:
    def __init__(self, world: World, oracle: Oracle, name: str, config: CheckpointConfig):
        self.w, self.oracle, self.name, self.config = world, oracle, name, config
        self.proc = Proc(name)
        self.actors: list[SimActor] = []
        self.coord: CheckpointCoordinator | None = None
        self.branch_from: int | None = None
        self.pending: int | None = None  # a background save not yet waited for
        self.mem: simmem.MemoryOracle | None = None  # with the memory tier: its truth

    def runtime(self) -> Runtime:
        lock = SimLock if self.w.memory is None else SimQueueLock  # (see SimQueueLock)
        return Runtime(to_thread=run_io, wall=self.w.clock.wall, lease_thread=False,
                       identity=self.proc.identity(), lock=lock)  # fmt: skip

    async def open(self) -> CheckpointCoordinator:
        failed = 0  # opens in a row that took the lease and then failed (I6: below)
        while True:
            coord: CheckpointCoordinator | None = None
            try:
                coord = CheckpointCoordinator(self.config, runtime=self.runtime())
            except (CheckpointLockedError, OSError):
                coord = None  # another job's lease: wait (virtual time) for it to expire
            except CheckpointError as e:
                if "cannot open" not in str(e):
                    raise
                failed += 1
                if failed >= OPEN_TRIES:
                    coord = self._open_without_faults(e)
            if coord is None:
                await asyncio.sleep(TTL / 2)
                continue
            self.oracle.opened(coord._lease.generation)
            if self.name != "job0" and not self.w.handed_over.done():
                self.w.handed_over.set_result(None)  # releases a held late COMMIT (world.py)
            # A process's leases die with it (lock.py keeps this process's in a registry).
            self.proc.on_kill.append(functools.partial(lock._LEASES.discard, coord._lease))
            return coord

    def _open_without_faults(self, error: CheckpointError) -> CheckpointCoordinator | None:
        """After OPEN_TRIES failed opens in a row, one more with no faults injected: at up to
        4% of requests failing, and dozens of requests an open, such a run happens without
        anything wrong; a folder that cannot be opened even then is stuck (I6). None: the
        lease is another job's (wait as usual). The constructor makes its storage calls
        without yielding, so no other process runs meanwhile."""
        f = self.w.faults
        kept = (f.fail, f.lost, f.delay)
        f.fail = f.lost = f.delay = 0.0
        try:
            return CheckpointCoordinator(self.config, runtime=self.runtime())
        except (CheckpointLockedError, OSError):
            return None
        except CheckpointError as e:
            raise Violation("I6 bounded", f"{self.name} cannot open, even without faults: "
                            f"{_brief(e)} (after {OPEN_TRIES}: {_brief(error)})") from e  # fmt: skip
        finally:
            f.fail, f.lost, f.delay = kept

    async def run(self, saves: int) -> None:
        w, rng = self.w, self.w.rng
        coord = self.coord = await self.open()
        for i in range(2):
            actor = SimActor(w, Proc(f"{self.name}.a{i}"), Component(f"c{i}"))
            self.actors.append(actor)
            coord.register(f"c{i}", actor)
        step = await self.load(None)
        for _ in range(saves):
            await self.flush()
            r = rng.random()
            # (listed only for a rollback: a listing per step was a fifth of every schedule)
            if r < 0.1 and len(steps := self.steps()) >= 2:
                step = await self.load(rng.choice(steps[:-1]), step)
                continue
            step += 1
            for a in self.actors:
                a.set_version.remote(step)  # training: runs after any earlier snapshot
            await self.save(step)
            if self.mem is not None and any(not a.proc.alive for a in self.actors):
                step = await self.recover(step)
                continue
            if r > 0.93 and self.pending is not None:
                await asyncio.sleep(rng.uniform(0.0, 0.05))  # maybe mid-commit by now
                w.log(f"{self.name} close() with a save in flight")
                coord.close()
                return
            if 0.86 < r < 0.93 and self.pending is not None:
                self.register_late()
        await self.flush()
        try:
            await coord.aclose()
        except (CheckpointError, OSError) as e:  # a persist's failure, raised at last
            self.w.log(f"{self.name} aclose() failed: {_brief(e)}")

    def steps(self) -> list[int]:
        assert self.coord is not None
        try:
            return self.coord.steps()
        except OSError:
            return []

    async def flush(self) -> None:
        """Wait for a background save and report its outcome."""
        assert self.coord is not None
        step, self.pending = self.pending, None
        if step is None:
            return
        try:
            res = await self.coord.wait(persisting=False)
        except (CheckpointError, OSError) as e:
            self.w.log(f"{self.name} save({step}) failed: {_brief(e)}")
            self.check_blame(e)
            return
        if res is not None and res.committed:
            self.reported(step, res.path)

    async def recover(self, step: int) -> int:
        """What a supervisor does when nodes were lost (docs/cluster.md): restart the dead
        actors on the nodes left, register them again, and load the newest whole step."""
        assert self.coord is not None
        await self.flush()
        for i, a in enumerate(self.actors):
            if not a.proc.alive:
                name = a.obj.name
                self.actors[i] = SimActor(self.w, Proc(f"{a.proc.name}r"), Component(name))
                self.coord.register(name, self.actors[i], replace=True, optional=name == "late")
        self.w.log(f"{self.name} recovers")
        return await self.load(None, step)

    def register_late(self) -> None:
        """register() while a background save runs (it must not join that save)."""
        assert self.coord is not None
        actor = SimActor(self.w, Proc(f"{self.name}.late"), Component("late"))
        self.actors = [a for a in self.actors if a.obj.name != "late"] + [actor]
        self.coord.register("late", actor, replace=True, optional=True)

    async def save(self, step: int) -> None:
        assert self.coord is not None
        try:
            # A caller's own deadline (asyncio.wait_for) may cancel a save at any await; drawn
            # from a generator of its own, so that the other draws of a seed stay as they were.
            if self.w.cancels.random() < CANCEL_SAVES:
                limit = self.w.cancels.uniform(0.0, 0.05)
                try:
                    res = await asyncio.wait_for(self.coord.save(step), limit)
                except asyncio.TimeoutError:
                    self.w.log(f"{self.name} save({step}) cancelled by the caller's deadline")
                    # Its commit may go on in its thread: a real next commit would wait for
                    # it on the coordinator's commit lock, which a greenlet cannot (one OS
                    # thread): wait here for the coordinator's storage calls to end instead.
                    coord = self.coord
                    await poll(lambda: coord._calls.busy, 0.001)
                    return
            else:
                res = await self.coord.save(step)
        except (CheckpointError, OSError) as e:
            self.w.log(f"{self.name} save({step}) failed: {_brief(e)}")
            self.check_blame(e)
            return
        if res.committed:
            self.reported(step, res.path)
        elif self.w.rng.random() < 0.5:
            self.pending = step
        else:
            self.pending = step
            await self.flush()

    def check_blame(self, e: BaseException) -> None:
        """I7: a job is told another job took its folder only if one did."""
        text = str(e)
        blamed = "another writer" in text or "lost the lease" in text
        assert self.coord is not None
        if blamed and self.oracle.lease_generation() <= self.coord._lease.generation:
            raise Violation("I7 no false alarm", f"{self.name}: {_brief(e)}")

    def reported(self, step: int, path: str) -> None:
        self.w.log(f"{self.name} save({step}) committed")
        if path.startswith("mem://"):  # to memory; durable only once persisted (observed then)
            assert self.mem is not None
            self.branch_from = None
            assert self.coord is not None
            mine = self.oracle.lease_generation() <= self.coord._lease.generation
            simmem.check_reported(self.mem, step, mine)
            self.oracle.check_storage()
            return
        assert self.coord is not None
        self.oracle.committed(step, self.branch_from, self.coord._lease.generation)
        self.branch_from = None
        self.oracle.check_storage()

    async def load(self, step: int | None, current: int = 0) -> int:
        assert self.coord is not None
        before = [a.obj.loads for a in self.actors]
        if self.mem is not None:
            want = simmem.expected_load(self.oracle, self.mem)
        else:  # what the load may return if the folder changes hands meanwhile
            self.oracle.refresh()
            want = self.oracle.expected_load()
        late = 0 if self.mem is None else self.mem.cluster.late
        try:
            res = await self.coord.load(step)
        except (CheckpointError, OSError) as e:
            self.w.log(f"{self.name} load({step}) failed: {_brief(e)}")
            if self.mem is not None:
                simmem.check_failed_load(e)
            after = [a.obj.loads for a in self.actors]
            changed = [
                a.obj.name for a, x, y in zip(self.actors, before, after, strict=True) if x != y
            ]
            if changed and ("nothing was applied" in str(e) or changed[0] not in str(e)):
                raise Violation("I4 all or nothing", f"failed load applied {changed}") from e
            return current
        got = None if res is None else res.step
        self.w.log(f"{self.name} load({step}) -> {got}")
        if step is None and self.mem is not None:
            simmem.check_load(self.oracle, self.mem, got, want, late)
        elif step is None:
            lost = self.oracle.lease_generation() > self.coord._lease.generation
            self.oracle.check_load(got, want, lost)
        if res is not None:
            self._check_applied(res.step, res.manifest)
            # load(None) that skipped a newer step (a memory step that lost its last copy, a
            # damaged durable one) is a rollback too: the checks above held it to the newest
            # whole step, and the next save replaces the skipped ones (docs/protocol.md).
            if step is not None or self.coord._timeline.branch_from is not None:
                self.branch_from = res.step
                if self.oracle.lease_generation() <= self.coord._lease.generation:
                    self.oracle.rolled_back(res.step)  # (a job taken over branches nothing:
                    # its saves fail; review 13 saw one move the holder's branch point)
        return got or 0

    def _check_applied(self, step: int, manifest: layout.Manifest) -> None:
        for a in self.actors:
            name = a.obj.name
            if name in manifest.components and a.obj.version != step:
                raise Violation("I4 all or nothing", f"{name} is at {a.obj.version}, load {step}")


def make_config(world: World) -> CheckpointConfig:
    rng = world.rng
    return CheckpointConfig(
        folder=world.folder,
        keep_last=rng.choice([1, 2, 3, None]),
        async_mode=_mode(rng.choice(["sync", "async", "deferred"])),
        lease_ttl_s=TTL,
        save_timeout_s=20.0,
        load_timeout_s=20.0,
        abort_timeout_s=5.0,
    )


def seed_sibling(world: World) -> dict:
    """A folder next to the job's whose name extends it (exp10 next to exp1)."""
    sib = open_storage(world.folder.replace("exp1", "exp10"))
    world.faults, saved = type(world.faults)(), world.faults
    sib.makedirs("step-1")
    sib.write("step-1/COMMIT", b"sibling")
    if world.s3:
        world.bucket.new_upload("runs/exp10/step-10/actors/x.msgpack")
    world.faults = saved
    return snapshot_sibling(world)


def snapshot_sibling(world: World) -> dict:
    if world.s3:
        return {
            "objects": {k: v for k, v in world.bucket.objects.items() if "exp10" in k},
            "uploads": {k: v[0] for k, v in world.bucket.uploads.items() if "exp10" in v[0]},
        }
    base = os.path.join(world.root, "bkt/runs/exp10")
    return {"files": sorted(os.path.relpath(os.path.join(d, f), base)
                            for d, _, fs in os.walk(base) for f in fs)}  # fmt: skip


async def _scenario(world: World, oracle: Oracle, jobs: list[Job]) -> None:
    rng = world.rng
    for n, job in enumerate(jobs):
        ctx = contextvars.copy_context()
        ctx.run(PROC.set, job.proc)
        task = ctx.run(world.loop.create_task, job.run(rng.randint(3, 9)))
        job.proc.tasks.append(task)
        simmem.faults_for_job(world, functools.partial(_procs, job))
        if rng.random() < 0.5:  # kill the job (or one of its actors) at a random moment
            victim = job.proc if rng.random() < 0.7 else None
            later = rng.uniform(0.0, 0.4)
            if not (world.late_commit and n == 0):  # (a held COMMIT stalls it instead)
                world.loop.call_later(later, _kill_later, world, job, victim)
        # A successor may not wait for the job to end: it takes the folder over as soon as
        # the lease of a stalled job expires (the stalled job's writes then land late).
        patience = TTL * rng.uniform(1.0, 3.0) if rng.random() < 0.3 else None
        if world.late_commit and n == 0:  # its COMMIT is held: the successor takes over
            patience = TTL * world.late.uniform(0.5, 1.5)
        try:
            await asyncio.wait_for(asyncio.shield(task), patience)
        except (Crash, asyncio.CancelledError):
            pass
        except asyncio.TimeoutError:
            world.log(f"{job.name} is still running: the next job starts anyway")
            continue
        world.kill(job.proc)
        for a in job.actors:
            world.kill(a.proc)
        oracle.check_storage()


def _procs(job: Job) -> list[Proc]:
    return [a.proc for a in job.actors]


def _kill_later(world: World, job: Job, victim: Proc | None) -> None:
    if victim is None and job.actors:
        victim = world.rng.choice(job.actors).proc
    if victim is not None:
        world.kill(victim)


def _hermetic() -> None:
    """Each schedule starts as a fresh process would: no storage, lease or world of an
    earlier one (a seed's outcome must not depend on the seeds run before it)."""
    from ..storage import _open
    from .loop import OrderedWeakSet, SimThread
    from .world import _WORLDS

    _open.clear()
    simmem.hermetic()
    lock._LEASES = OrderedWeakSet()  # in the order taken, whatever ran before in this process
    SimThread._by_greenlet.clear()
    _WORLDS.clear()


def run_seed(seed: int) -> Outcome:
    _hermetic()
    # Durability is the power-loss tests' subject (tests/test_powerloss.py), not this one's.
    os.environ["FORGE_CKPT_FAULT"] = "fsync:skip,fsync_dir:skip"
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="forge-sim-", dir=shm) as root:
        world = World(seed, s3=seed % 2 == 1, root=root, ttl=TTL)
        violation = None
        try:
            violation = _run(world)
        finally:
            world.loop.close()
        return Outcome(seed, violation, world.events, world.s3)


def _run(world: World) -> str | None:
    config = simmem.setup(world, make_config(world))
    world.log(f"config: {config.async_mode} keep_last={config.keep_last} faults={world.faults}")
    if config.memory_every:
        world.log(f"memory tier: durable_every={config.durable_every} memory_keep="
                  f"{config.memory_keep} nodes={world.memory.alive} slow={world.memory.slow}")  # fmt: skip
    oracle = Oracle(_ungated(world), _ungated(world, "/replaced"), config.keep_last)
    oracle.changes = world.changes
    world.observers.append(oracle.observe)
    jobs = [Job(world, oracle, f"job{i}", config) for i in range(3)]
    for job in jobs:
        job.mem = simmem.oracle_for(world, config)
    sibling = seed_sibling(world)
    world.loop.set_exception_handler(lambda loop, ctx: None)
    try:
        try:
            world.loop.run_until_complete(_scenario(world, oracle, jobs))
        except Exception:
            if world.violation is None:
                raise
        if world.violation is not None:
            raise world.violation
        if snapshot_sibling(world) != sibling:
            raise Violation("I5 folders", "the sibling folder exp10 was changed")
    except AssertionError as v:
        world.log(f"VIOLATION {v}")
        return str(v)
    except Deadlock as e:
        world.log(f"VIOLATION I6 bounded: {e}")
        return f"I6 bounded: {e}"
    finally:
        _drain(world, jobs)
    try:  # once every request still in flight has landed: are the listed steps whole?
        if CHECK_FILES:
            oracle.check_files()
    except AssertionError as v:
        world.log(f"VIOLATION {v}")
        return str(v)
    return None


def _drain(world: World, jobs: list[Job]) -> None:
    """Kill everything, then let the requests still in flight land or fail, so that no
    thread is left waiting at a gate."""
    for job in jobs:
        world.kill(job.proc)
        for a in job.actors:
            world.kill(a.proc)
    world.faults.delay = 0.0
    try:
        world.loop.run_until_complete(asyncio.sleep(10 * TTL))
    except Deadlock:
        pass


def _ungated(world: World, sub: str = "") -> Storage:
    """The job's folder as the oracle reads it: the same storage code, no faults, no delays."""
    from ..storage import StorageSpec
    from ..storage.local import LocalStorage
    from ..storage.s3 import S3Storage
    from .s3server import Client

    if world.s3:
        store = S3Storage(StorageSpec("s3://bkt/runs/exp1" + sub, {"max_concurrency": 1}))
        store.client = Client(world.bucket, lambda op, key, mutates: "ok")
        return store
    return LocalStorage(StorageSpec(os.path.join(world.root, "bkt/runs/exp1" + sub)))


def _brief(e: BaseException) -> str:
    return " | ".join(str(e).splitlines()[:4])


def _mode(drawn: str) -> Literal["sync", "deferred"]:
    """'async' is now 'deferred' (config.py); drawn from the same three-way choice so that
    every seed's other draws, and so its trace, stay what they were."""
    return "sync" if drawn == "sync" else "deferred"
