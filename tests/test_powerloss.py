"""forge_ckpt's save under power loss, not just SIGKILL (the page cache survives a SIGKILL).

A 1-rank trainer and two Checkpointable actors save steps 1 and 2 into a folder on the powerfs
FUSE mount, which logs every filesystem operation of every process. Then, for every op from the
start of step 2's save to the end of the log, the power is "cut" right after it: the durable
state the strict POSIX model leaves is written to a real folder and a fresh coordinator loads
it. It must load step 1 or 2 exactly as saved, and step 2 once step 2's commit point was
durable (its COMMIT and the lease recording it) or `save()` returned. With the library's directory or file fsyncs skipped (FORGE_CKPT_FAULT), the
same harness must report losses: that is the proof it would catch a missing fsync.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from forge_ckpt import Checkpointable, CheckpointConfig, CheckpointCoordinator, spawn_trainer_ranks
from forge_ckpt.errors import CheckpointLeaseCorruptError
from forge_ckpt.steps import layout, lease_record

sys.path.insert(0, os.path.dirname(__file__))
import _trainer_model  # noqa: E402
from powerfs.fuse import fuse_unavailable, start_or_skip  # noqa: E402
from powerfs.model import DurableTree, Op, durable_states, replay  # noqa: E402

COMMIT_2 = "ckpt/step-2/COMMIT"  # the step layout: step-N/ ... COMMIT written last
LEASE = "ckpt/.forge_ckpt.lease"  # records COMMIT: the commit point (forge_ckpt/steps/lock.py)


class Holder(Checkpointable):
    """An actor with tensors, numpy arrays and its own generator (wrapped by ray.remote)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.weights = torch.randn(64, 32, generator=torch.Generator().manual_seed(seed))
        self.table = self.rng.standard_normal(2048)
        self.count = 0

    def rng_generators(self) -> dict[str, Any]:
        return {"rng": self.rng}

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "table": self.table, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weights = state["weights"].clone()
        self.table = np.array(state["table"])
        self.count = state["count"]

    def advance(self) -> None:
        self.weights += 1.0
        self.table = self.table * 0.5 + self.rng.standard_normal(self.table.shape)
        self.count += 1

    def get(self) -> dict[str, Any]:
        probe = np.random.default_rng()
        probe.bit_generator.state = self.rng.bit_generator.state  # the stream, not a draw
        return {"state": self.state_dict(), "next": probe.random(2)}

    def set_fault(self, spec: str | None) -> None:
        if spec is None:
            os.environ.pop("FORGE_CKPT_FAULT", None)
        else:
            os.environ["FORGE_CKPT_FAULT"] = spec


def equal(a: Any, b: Any) -> bool:
    """Bitwise equality of nested states (tensors and arrays compared by bytes)."""
    if isinstance(a, torch.Tensor):
        raw = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*raw)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class Job:
    """The components of one job, reused by every coordinator of the module (fast loads)."""

    def __init__(self, ray: Any) -> None:
        ray.cloudpickle.register_pickle_by_value(_trainer_model)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        rank_cls = ray.remote(num_cpus=0)(_trainer_model.TrainerRank)
        self.ray = ray
        self.ranks = spawn_trainer_ranks(rank_cls, 1)
        ray.get([r.setup.remote(0) for r in self.ranks])
        holder = ray.remote(num_cpus=0)(Holder)
        self.actors = {"policy": holder.remote(1), "buffer": holder.remote(2)}

    def coordinator(self, folder: str) -> CheckpointCoordinator:
        coord = CheckpointCoordinator(CheckpointConfig(folder=folder, keep_last=None))
        coord.set_trainer(self.ranks)
        for name, actor in self.actors.items():
            coord.register(name, actor)
        return coord

    async def advance(self) -> None:
        """Change every component's state (also makes a load that restored nothing visible)."""
        for r in self.ranks:
            await r.train.remote(1)
        for a in self.actors.values():
            await a.advance.remote()

    async def state(self) -> dict[str, Any]:
        out = {name: await a.get.remote() for name, a in self.actors.items()}
        out["trainer"] = [await r.summary.remote() for r in self.ranks]
        out["trainer_rng"] = [await r.rng_state.remote() for r in self.ranks]
        return out

    @contextlib.asynccontextmanager
    async def fault(self, spec: str | None) -> AsyncIterator[None]:
        """FORGE_CKPT_FAULT in every process that writes checkpoint files (driver included)."""
        if spec is None:
            yield
            return
        calls = [r.inject_fault.remote for r in self.ranks]
        calls += [a.set_fault.remote for a in self.actors.values()]
        os.environ["FORGE_CKPT_FAULT"] = spec
        try:
            for call in calls:
                await call(spec)
            yield
        finally:
            os.environ.pop("FORGE_CKPT_FAULT", None)
            for call in calls:
                await call(None)

    async def load(self, folder: str, saved: dict[int, Any]) -> tuple[int | None, str | None]:
        """Load `folder` with a fresh coordinator: (step, problem or None)."""
        await self.advance()
        try:
            coord = self.coordinator(folder)
        except Exception as e:
            return None, f"cannot open the folder: {type(e).__name__}: {e}"
        try:
            result = await coord.load()
        except Exception as e:
            return None, f"load failed: {type(e).__name__}: {e}"
        finally:
            coord.close()
        if result is None:
            return None, "no committed step at all"
        if result.step not in saved:
            return result.step, f"loaded step {result.step}, which was never saved"
        state = await self.state()
        differ = [k for k in state if not equal(state[k], saved[result.step][k])]
        if differ:
            return result.step, f"loaded step {result.step} but {differ} differ from what was saved"
        return result.step, None


@dataclass
class Report:
    """What the enumeration of cut points found."""

    failures: list[str] = field(default_factory=list)
    cuts: int = 0  # cut points enumerated
    distinct: int = 0  # distinct durable states (each loaded once)
    ops: int = 0
    start: int = 0  # op index where the save of step 2 starts
    commit_durable_at: int | None = None
    loaded: dict[int | None, int] = field(default_factory=dict)  # step -> cut points
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"{self.cuts} cut points (after the first k ops, k = {self.start}..{self.ops}), "
            f"{self.distinct} distinct durable states, step-2 COMMIT durable from k = "
            f"{self.commit_durable_at}, loads "
            f"per step {self.loaded}, {len(self.failures)} failures, {self.seconds:.1f} s"
        )


async def save_two_steps(
    job: Job, mountpoint: str, fault: str | None
) -> tuple[list[Op], int, dict]:
    """Save step 1, change everything, save step 2 (under `fault`); the op log and the
    index where step 2's save started."""
    fs = start_or_skip(mountpoint)
    try:
        coord = job.coordinator(os.path.join(mountpoint, "ckpt"))
        try:
            await job.advance()
            assert (await coord.save(1)).committed
            saved = {1: await job.state()}
            await job.advance()
            saved[2] = await job.state()
            start = len(fs.oplog())
            async with job.fault(fault):
                assert (await coord.save(2)).committed
            oplog = fs.oplog()  # save() returned: the library says step 2 is durable now
        finally:
            coord.close()
    finally:
        fs.stop()
    return oplog, start, saved


def _reboot(folder: str) -> None:
    """After a power cut no process from before it is alive: a reboot gives every pid another
    start time, which is how the lease tells a dead holder on this host from a live one. Our
    saving process is still alive, so give its lease a start time no process has."""
    path = os.path.join(folder, ".forge_ckpt.lease")
    try:
        with open(path, "rb") as f:
            holder = lease_record.parse_lease(f.read(), path)
    except (FileNotFoundError, CheckpointLeaseCorruptError):
        return  # no lease, or a damaged one (fsyncs skipped): the load reports it
    if holder.get("pid_start") is not None:
        holder["pid_start"] = "before-the-power-cut"
        with open(path, "wb") as f:  # sealed again: its CRC32C covers the field changed
            f.write(lease_record.seal_lease(holder))


def _commit_2_durable(tree: DurableTree, final: DurableTree) -> bool:
    """Step 2's commit point is durable: its COMMIT, and the lease's record of that COMMIT."""
    if COMMIT_2 not in final or tree.get(COMMIT_2) != final[COMMIT_2]:
        return False
    try:
        lease = json.loads(tree.get(LEASE) or b"")
    except ValueError:
        return False
    record = lease_record.parse_record(lease) if isinstance(lease, dict) else None
    return record is None or (
        2 in record and record[2] == layout.marker_generation(final[COMMIT_2] or b"")
    )


def _fingerprint(tree: DurableTree) -> str:
    h = hashlib.sha256()
    for path, data in sorted(tree.items()):
        h.update(f"{path}\0{'d' if data is None else len(data)}\0".encode())
        h.update(data or b"")
    return h.hexdigest()


async def power_cut_failures(job: Job, tmp: str, fault: str | None = None) -> Report:
    """Save two steps on powerfs, then cut the power after every op of step 2's save and
    load what survives. Returns the report; `failures` lists every cut point that lost data."""
    began = time.perf_counter()
    oplog, start, saved = await save_two_steps(job, os.path.join(tmp, "mnt"), fault)
    final = replay(oplog).volatile_tree()
    report = Report(ops=len(oplog), start=start)
    results: dict[str, tuple[int | None, str | None]] = {}
    for k, model in durable_states(oplog, start):
        tree = model.durable_tree()
        committed = _commit_2_durable(tree, final)
        if committed and report.commit_durable_at is None:
            report.commit_durable_at = k
        key = _fingerprint(tree)
        if key not in results:
            dest = os.path.join(tmp, f"cut-{k}")
            model.materialize(dest)
            _reboot(os.path.join(dest, "ckpt"))
            step, problem = await job.load(os.path.join(dest, "ckpt"), saved)
            results[key] = step, problem and problem.replace(dest, "<cut>")
            shutil.rmtree(dest)
        step, problem = results[key]
        report.cuts += 1
        report.loaded[step] = report.loaded.get(step, 0) + 1
        where = f"cut after the first {k} of {len(oplog)} ops"
        if problem:
            report.failures.append(f"{where}: {problem}")
        elif step != 2 and (committed or report.commit_durable_at is not None):
            report.failures.append(f"{where}: step 2's COMMIT was durable, but step {step} loaded")
        elif step != 2 and k == len(oplog):
            report.failures.append(f"{where}: save(2) had returned, but step {step} loaded")
    report.distinct = len(results)
    report.seconds = time.perf_counter() - began
    return report


@pytest.fixture(scope="module")
def job(request):
    reason = fuse_unavailable()  # before paying for Ray
    if reason:
        print(f"powerfs: skipping, {reason}", file=sys.stderr)
        pytest.skip(f"FUSE power-loss filesystem unavailable: {reason}")
    return Job(request.getfixturevalue("ray_local"))


async def test_save_survives_a_power_cut_after_every_op(job, tmp_path):
    report = await power_cut_failures(job, str(tmp_path))
    print("power cut, no fault:", report.summary())
    assert report.failures == []
    assert report.commit_durable_at is not None
    assert report.loaded.get(1) and report.loaded.get(2)  # both outcomes were reached
    assert report.distinct > 5


@pytest.mark.parametrize("fault", ["fsync_dir:skip", "fsync:skip"])
async def test_harness_reports_losses_when_fsyncs_are_skipped(job, tmp_path, fault):
    report = await power_cut_failures(job, str(tmp_path), fault)
    print(f"power cut, FORGE_CKPT_FAULT={fault}:", report.summary())
    for line in report.failures:
        print("  ", line)
    assert report.failures, f"skipping {fault} went unnoticed: {report.summary()}"
