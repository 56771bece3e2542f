"""Real storage faults under a saving job: a full disk, a read-only folder, failing fsync in a
component's process, and a background write that runs out of space.

Every fault is real: a small tmpfs that fills up (`mount -t tmpfs -o size=8m`), a remount
read-only, or `FORGE_CKPT_FAULT` in the environment of the component's own process. Each test
checks that the save raises a `CheckpointSaveError` naming the failing component and the cause,
that nothing of the failed step is committed or left behind, that the previous step is still the
newest, passes `forge-ckpt verify` and loads with its values, and that once the fault is gone
the next save commits. Mounting needs root (CAP_SYS_ADMIN): without it those tests are skipped.

The actors and the trainer rank are shared by the module's tests (a trainer rank is a torch +
TorchTitan import); each test sets their state first.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import ray
from typer.testing import CliRunner

from forge_ckpt import (
    Checkpointable,
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointError,
    CheckpointSaveError,
    spawn_trainer_ranks,
)
from forge_ckpt.cli import app
from forge_ckpt.steps import layout

sys.path.insert(0, os.path.dirname(__file__))
from crash_actors import _trainer_cls, make_trainer_ranks  # noqa: E402

SMALL = 4096  # bytes of actor state that always fit
BIG = 16 * 1024 * 1024  # twice the whole tmpfs
NOSPC = "[Errno 28] No space left on device"
EROFS = "[Errno 30] Read-only file system"
EIO_INJECTED = "[Errno 5] Input/output error (injected by FORGE_CKPT_FAULT)"


@ray.remote
class Big(Checkpointable):
    """An actor whose state is as large as the test wants; `hold` makes its next snapshot wait
    until a file exists, so a test can change the disk in the middle of a save."""

    def __init__(self) -> None:
        self.tag = 0
        self.blob = np.zeros(0, dtype=np.float32)
        self.gate: str | None = None

    def configure(self, tag: int, nbytes: int) -> None:
        self.tag = tag
        self.blob = np.full(nbytes // 4, tag, dtype=np.float32)

    def hold(self, gate: str) -> None:
        self.gate = gate

    def state_dict(self):
        gate, self.gate = self.gate, None
        deadline = time.monotonic() + 60
        while gate is not None and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"tag": self.tag, "blob": self.blob}

    def load_state_dict(self, state) -> None:
        self.tag = state["tag"]
        self.blob = np.array(state["blob"])

    def get(self) -> dict:
        return {"tag": self.tag, "nbytes": self.blob.nbytes, "sum": float(self.blob.sum())}


@pytest.fixture(scope="module")
def actors(ray_local):
    """One actor and one trainer rank (world size 1), healthy, shared by the module's tests."""
    big = Big.remote()
    trainer = make_trainer_ranks(1)
    yield big, trainer
    for a in [big, *trainer]:
        ray.kill(a)


class Disk:
    """Mounts tmpfs folders and opens coordinators; `cleanup` closes the coordinators (their
    lock files) before unmounting."""

    def __init__(self, tmp_path) -> None:
        self.tmp_path = tmp_path
        self.mounts: list[str] = []
        self.coords: list[CheckpointCoordinator] = []

    def mount(self, size: str = "8m") -> str:
        path = str(self.tmp_path / f"tmpfs{len(self.mounts)}")
        os.makedirs(path)
        if shutil.which("mount") is None:
            pytest.skip("no `mount` command: cannot create a small tmpfs to fill up")
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(
                f"cannot mount a tmpfs (needs root with CAP_SYS_ADMIN, e.g. not in an "
                f"unprivileged container): {proc.stderr.strip()}"
            )
        self.mounts.append(path)
        return path

    def remount(self, path: str, mode: str, retry_s: float = 0.0) -> None:
        """`mount -o remount,ro|rw`; retries while the kernel answers busy (a file on the
        tmpfs is open for writing: a component still writing)."""
        deadline = time.monotonic() + retry_s
        while True:
            cmd = ["mount", "-o", f"remount,{mode}", path]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode == 0:
                return
            if "busy" not in proc.stderr or time.monotonic() > deadline:
                raise AssertionError(f"remount,{mode} {path} failed: {proc.stderr.strip()}")
            time.sleep(0.02)

    def coordinator(self, folder: str, big, trainer=None, **kw) -> CheckpointCoordinator:
        coord = CheckpointCoordinator(CheckpointConfig(folder=folder, save_timeout_s=120, **kw))
        self.coords.append(coord)
        coord.register("big", big)
        if trainer is not None:
            coord.set_trainer(trainer)
        return coord

    def cleanup(self) -> None:
        for coord in self.coords:
            coord.close()
        # A coordinator whose construction failed never closes its lock file (a bug, see
        # test_failed_start_releases_the_folder_lock): close it here, so that the flock and the
        # fd do not outlive the test.
        lockfile = str(self.tmp_path / "lockfile")
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}") == lockfile:
                    os.close(int(fd))
            except OSError:
                pass
        for path in reversed(self.mounts):
            if subprocess.run(["umount", path], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", path], capture_output=True)


@pytest.fixture
def disk(tmp_path):
    d = Disk(tmp_path)
    yield d
    d.cleanup()


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: str, leave: int) -> str:
    """A ballast file that leaves `leave` bytes free on the file system of `path`."""
    ballast = os.path.join(path, "ballast")
    todo = free_bytes(path) - leave
    assert todo > 0
    chunk = b"\xa5" * (1 << 20)
    with open(ballast, "wb") as f:
        while todo > 0:
            todo -= f.write(chunk[: min(todo, len(chunk))])
    assert abs(free_bytes(path) - leave) <= 4096, free_bytes(path)
    return ballast


def failures(err: CheckpointSaveError, step: int, prev: int) -> dict[str, str]:
    """The failed units of a save error, label -> cause; checks the frame of the message."""
    head, *body, tail = str(err).splitlines()
    assert head == (
        f"save of step {step} aborted, nothing was committed "
        f"(step {prev} is still the newest committed step):"
    ), str(err)
    assert tail == "Fix or restart the failing component(s) and save again.", str(err)
    return dict(line.strip().split(": ", 1) for line in body)


async def state_of(big, trainer=None) -> dict:
    out = {"big": await big.get.remote()}
    if trainer is not None:
        out["trainer"] = await trainer[0].fingerprint.remote()
    return out


async def change(big, trainer=None, tag: int = 99) -> None:
    """Move every component away from the saved state, so that a load has to restore it."""
    await big.configure.remote(tag, SMALL)
    if trainer is not None:
        await asyncio.gather(*(t.train_step.remote() for t in trainer))


async def assert_previous_intact(coord, failed: int, prev: int, want: dict, big, trainer=None):
    folder = coord.config.folder
    assert coord.steps()[-1] == prev and failed not in coord.steps()
    assert not os.path.exists(os.path.join(layout.step_dir(folder, failed), layout.MARKER))
    result = CliRunner().invoke(app, ["verify", layout.step_dir(folder, prev)])
    assert result.exit_code == 0, result.output
    assert "files intact" in result.output and "FAIL" not in result.output
    await change(big, trainer)
    assert (await coord.load()).step == prev
    assert await state_of(big, trainer) == want


# ---- 1. a full disk ------------------------------------------------------------------------


async def test_full_disk_actor_then_trainer(actors, disk):
    big, trainer = actors
    mnt = disk.mount("8m")
    coord = disk.coordinator(os.path.join(mnt, "ckpt"), big, trainer)
    folder = coord.config.folder
    await big.configure.remote(1, SMALL)
    await trainer[0].train_step.remote()
    assert (await coord.save(1)).committed
    want1 = await state_of(big, trainer)

    # The actor's own write fills the disk. The trainer writes at the same time and may find
    # the disk full too: then it must be named with the same cause.
    await big.configure.remote(2, BIG)
    await trainer[0].train_step.remote()
    with pytest.raises(CheckpointSaveError) as e:
        await coord.save(2)
    failed = failures(e.value, 2, 1)
    assert failed["actor 'big' replica 0"] == f"OSError: {NOSPC}"
    assert all(NOSPC in cause for cause in failed.values()), failed
    assert layout.all_steps(folder) == [1]
    assert free_bytes(mnt) > 7 * 1024 * 1024  # the partial 8 MB file went with the step
    await assert_previous_intact(coord, 2, 1, want1, big, trainer)

    # The trainer's DCP shard does not fit: a ballast leaves half of what the trainer wrote at
    # step 1, far more than the actor's one small file needs.
    manifest = layout.read_committed(folder, 1)
    trainer_bytes = sum(f.size for f in manifest.components[layout.TRAINER].files)
    assert trainer_bytes > 16 * SMALL, trainer_bytes
    ballast = fill(mnt, leave=trainer_bytes // 2 // 4096 * 4096)
    await trainer[0].train_step.remote()
    with pytest.raises(CheckpointSaveError) as e:
        await coord.save(2)
    failed = failures(e.value, 2, 1)
    # DCP's write through our storage writer fails (the rank unwraps DCP's
    # CheckpointException); the actor's file usually fits, but if the trainer took the space
    # first the actor is named with the same cause.
    assert failed["trainer rank 0"].startswith("OSError: "), failed
    assert NOSPC in failed["trainer rank 0"], failed
    assert all(NOSPC in cause for cause in failed.values()), failed
    assert layout.all_steps(folder) == [1]
    await assert_previous_intact(coord, 2, 1, want1, big, trainer)

    os.unlink(ballast)  # space freed
    await change(big, trainer, tag=3)
    want2 = await state_of(big, trainer)
    assert (await coord.save(2)).committed and coord.steps() == [1, 2]
    assert CliRunner().invoke(app, ["verify", layout.step_dir(folder, 2)]).exit_code == 0
    await change(big, trainer)
    assert (await coord.load()).step == 2 and await state_of(big, trainer) == want2


# ---- 2. a read-only folder -----------------------------------------------------------------


def lock_elsewhere(disk: Disk, folder: str) -> None:
    """Create the folder. (`mount -o remount,ro` refuses while a file on the file system is
    open for writing; the lease is a file written and closed at each renewal, so nothing of
    the coordinator stays open and the tmpfs can be turned read-only under it.)"""
    del disk
    os.makedirs(folder)


async def test_read_only_folder(actors, disk):
    big, trainer = actors
    mnt = disk.mount("8m")
    folder = os.path.join(mnt, "ckpt")
    lock_elsewhere(disk, folder)
    other = os.path.join(mnt, "other")  # a second job's folder, with its lock file on the tmpfs
    CheckpointCoordinator(CheckpointConfig(folder=other)).close()
    coord = disk.coordinator(folder, big, trainer)
    await big.configure.remote(1, SMALL)
    await trainer[0].train_step.remote()
    assert (await coord.save(1)).committed
    want1 = await state_of(big, trainer)

    disk.remount(mnt, "ro")
    await change(big, trainer, tag=2)
    with pytest.raises(CheckpointSaveError) as e:
        await coord.save(2)
    # The driver cannot even create the step folder: no component was asked to save.
    failed = failures(e.value, 2, 1)
    step2 = layout.step_dir(folder, 2)
    assert failed == {"preparing the step": f"OSError: {EROFS}: '{step2}'"}
    assert layout.all_steps(folder) == [1]
    # Verify and load only read: both work on the read-only folder.
    await assert_previous_intact(coord, 2, 1, want1, big, trainer)

    # A new job cannot start on a read-only folder: the coordinator takes a lock (a file opened
    # read-write) at construction. The error says which folder and why.
    with pytest.raises(CheckpointError, match="cannot open checkpoint folder") as e:
        CheckpointCoordinator(CheckpointConfig(folder=other))
    assert other in str(e.value) and "Read-only file system" in str(e.value)
    assert e.value.__cause__.errno == errno.EROFS

    disk.remount(mnt, "rw")
    await change(big, trainer, tag=3)
    want2 = await state_of(big, trainer)
    assert (await coord.save(2)).committed and coord.steps() == [1, 2]
    await change(big, trainer)
    assert (await coord.load()).step == 2 and await state_of(big, trainer) == want2


async def test_folder_turns_read_only_during_save(actors, disk, caplog):
    """The step folder exists when the file system turns read-only: the aborted step cannot be
    removed. It has no marker (so it is no step) and the next start removes it."""
    big, trainer = actors
    mnt = disk.mount("8m")
    folder = os.path.join(mnt, "ckpt")
    lock_elsewhere(disk, folder)
    coord = disk.coordinator(folder, big, trainer)
    await big.configure.remote(1, SMALL)
    await trainer[0].train_step.remote()
    assert (await coord.save(1)).committed
    want1 = await state_of(big, trainer)

    await change(big, trainer, tag=2)
    gate = str(disk.tmp_path / "go")
    await big.hold.remote(gate)
    save = asyncio.create_task(coord.save(2))
    step2 = layout.step_dir(folder, 2)
    deadline = time.monotonic() + 60
    while not os.path.isdir(step2):
        assert time.monotonic() < deadline and not save.done(), "step folder never created"
        await asyncio.sleep(0.01)
    disk.remount(mnt, "ro", retry_s=60)  # busy while the trainer rank still writes
    open(gate, "w").close()
    with caplog.at_level(logging.WARNING, logger="forge_ckpt"):
        with pytest.raises(CheckpointSaveError) as e:
            await save
    failed = failures(e.value, 2, 1)
    big_file = re.escape(os.path.join(step2, "actors", "big.0.")) + r"g\d+s\d+\.msgpack"
    assert re.fullmatch(
        f"OSError: {re.escape(EROFS)}: '{big_file}'", failed["actor 'big' replica 0"]
    )
    assert all(EROFS in cause for cause in failed.values()), failed  # the trainer, if it was late
    assert f"could not remove aborted step {step2}" in caplog.text
    assert "it is not committed and will be removed at the next start" in caplog.text
    assert layout.all_steps(folder) == [1, 2]  # the leftover, without a marker
    await assert_previous_intact(coord, 2, 1, want1, big, trainer)
    coord.close()

    disk.remount(mnt, "rw")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="forge_ckpt"):
        coord = disk.coordinator(folder, big, trainer)  # the next start
    assert "removed uncommitted leftover step-2" in caplog.text
    assert layout.all_steps(folder) == [1] and coord.steps() == [1]
    await change(big, trainer, tag=3)
    want2 = await state_of(big, trainer)
    assert (await coord.save(2)).committed and coord.steps() == [1, 2]
    await change(big, trainer)
    assert (await coord.load()).step == 2 and await state_of(big, trainer) == want2


def leftover_on_read_only_folder(disk: Disk) -> str:
    """A folder holding an uncommitted leftover step-5, on a read-only tmpfs; the lock lives on
    a writable disk, so a coordinator gets as far as removing the leftover."""
    mnt = disk.mount("8m")
    folder = os.path.join(mnt, "ckpt")
    lock_elsewhere(disk, folder)
    os.makedirs(os.path.join(folder, "step-5", "actors"))
    with open(os.path.join(folder, "step-5", "actors", "big.0.msgpack"), "wb") as f:
        f.write(b"partial")
    disk.remount(mnt, "ro")
    return folder


def test_start_with_unremovable_leftover_names_it(disk, caplog):
    """The leftover has no marker, so it is no step; on a read-only folder the job cannot take
    the folder's lease (a file it must write), so the start fails naming the folder and the
    cause (or, where the lease could be written, the warning names the leftover)."""
    folder = leftover_on_read_only_folder(disk)
    with caplog.at_level(logging.WARNING, logger="forge_ckpt"):
        try:
            disk.coords.append(CheckpointCoordinator(CheckpointConfig(folder=folder)))
        except (OSError, CheckpointError) as e:
            told = str(e)
        else:
            told = caplog.text
    assert folder in told and "Read-only file system" in told, told


def test_failed_start_releases_the_folder_lock(tmp_path, monkeypatch):
    """A start that fails after taking the lock must release it, so the job can retry."""
    from forge_ckpt.steps import commit

    folder = str(tmp_path / "ckpt")
    real = commit.remove_uncommitted

    def failing(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(commit, "remove_uncommitted", failing)
    with pytest.raises(CheckpointError, match="cannot open checkpoint folder .*Input/output"):
        CheckpointCoordinator(CheckpointConfig(folder=folder))
    monkeypatch.setattr(commit, "remove_uncommitted", real)
    CheckpointCoordinator(CheckpointConfig(folder=folder)).close()  # the retry gets the lock


# ---- 3. I/O errors in a component's own process ----------------------------------------------


async def test_failing_fsync_in_actor_and_trainer_processes(actors, disk, tmp_path):
    big, trainer = actors
    fault = {"env_vars": {"FORGE_CKPT_FAULT": "fsync:EIO"}}
    bad_big = Big.options(runtime_env=fault).remote()  # starts while the trainer rank does
    bad_trainer = spawn_trainer_ranks(_trainer_cls().options(runtime_env=fault), 1)
    try:
        await bad_trainer[0].setup.remote(7)  # other initial weights than the healthy rank's
        coord = disk.coordinator(str(tmp_path / "ckpt"), big, trainer)
        folder = coord.config.folder
        await big.configure.remote(1, SMALL)
        await trainer[0].train_step.remote()
        assert (await coord.save(1)).committed
        want1 = await state_of(big, trainer)

        # Both restarted on a node whose disk fails fsync.
        coord.register("big", bad_big, replace=True)
        coord.set_trainer(bad_trainer)
        await change(bad_big, bad_trainer, tag=2)
        with pytest.raises(CheckpointSaveError) as e:
            await coord.save(2)
        # Plain OSErrors for both: the trainer's DCP shards go through forge_ckpt's storage
        # writer, whose fsync fails first (the rank unwraps DCP's CheckpointException).
        assert failures(e.value, 2, 1) == {
            "actor 'big' replica 0": f"OSError: {EIO_INJECTED}",
            "trainer rank 0": f"OSError: {EIO_INJECTED}",
        }
        assert layout.all_steps(folder) == [1]
        # Reading is not affected: the faulty processes load step 1.
        await assert_previous_intact(coord, 2, 1, want1, bad_big, bad_trainer)

        # What the faulty rank leaves when saving on its own: nothing (the shard whose fsync
        # failed is removed by its writer; DCP never reaches `.metadata`; no rank file).
        scratch = str(tmp_path / "scratch")
        os.makedirs(os.path.join(scratch, layout.TRAINER))
        with pytest.raises(ray.exceptions.RayTaskError, match="Input/output error"):
            await bad_trainer[0].forge_begin_save.remote(scratch, "", False)
        assert set(os.listdir(scratch)) == {layout.TRAINER}
        assert os.listdir(os.path.join(scratch, layout.TRAINER)) == []

        coord.register("big", big, replace=True)  # a healthy replacement: only the trainer fails
        await change(big, bad_trainer, tag=3)
        with pytest.raises(CheckpointSaveError) as e:
            await coord.save(2)
        assert failures(e.value, 2, 1) == {"trainer rank 0": f"OSError: {EIO_INJECTED}"}
        assert layout.all_steps(folder) == [1]
        await assert_previous_intact(coord, 2, 1, want1, big, bad_trainer)

        coord.set_trainer(trainer)
        await change(big, trainer, tag=4)
        want2 = await state_of(big, trainer)
        assert (await coord.save(2)).committed and coord.steps() == [1, 2]
        assert CliRunner().invoke(app, ["verify", layout.step_dir(folder, 2)]).exit_code == 0
        await change(big, trainer)
        assert (await coord.load()).step == 2 and await state_of(big, trainer) == want2
    finally:
        for a in [bad_big, *bad_trainer]:
            ray.kill(a)


# ---- 4. async mode: the background write runs out of space -----------------------------------


async def test_async_background_write_hits_full_disk(actors, disk, caplog):
    big, _ = actors
    mnt = disk.mount("8m")
    coord = disk.coordinator(os.path.join(mnt, "ckpt"), big, async_mode="deferred")
    folder = coord.config.folder
    await big.configure.remote(1, SMALL)
    await coord.save(1)
    assert (await coord.wait()).committed
    want1 = await state_of(big)

    await big.configure.remote(2, BIG)
    result = await coord.save(2)  # returns once the actor holds its snapshot
    assert not result.committed
    await big.configure.remote(5, SMALL)  # the job goes on while the write fails
    with pytest.raises(CheckpointSaveError) as e:
        await coord.wait()
    assert failures(e.value, 2, 1) == {"actor 'big' replica 0": f"OSError: {NOSPC}"}
    assert "background save failed (raised again by the next save() or wait())" in caplog.text
    assert layout.all_steps(folder) == [1]
    await assert_previous_intact(coord, 2, 1, want1, big)

    await change(big, tag=3)  # state that fits
    want2 = await state_of(big)
    result = await coord.save(2)
    assert not result.committed
    assert (await coord.wait()).committed and coord.steps() == [1, 2]
    await change(big)
    assert (await coord.load()).step == 2 and await state_of(big) == want2
