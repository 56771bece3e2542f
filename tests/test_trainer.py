"""The trainer integration with real gloo process groups, real Ray actors, real TorchTitan.

Each world size (1: plain module; 2: FSDP2, so every rank holds different shards) trains a few
steps, saves step 3 synchronously, keeps training (the uninterrupted reference), then saves
step 6 in the background while a training step changes the weights. Fresh rank actors load
those steps; stock TorchTitan loads them too. Spawning rank actors (a torch + TorchTitan import
each) is most of the time, so the saving runs are shared by the module's tests.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import _trainer_model  # noqa: E402

from forge_ckpt import serialization  # noqa: E402
from forge_ckpt.errors import CheckpointCorruptError, CheckpointError  # noqa: E402
from forge_ckpt.steps import layout  # noqa: E402
from forge_ckpt.storage import FileRecord, open_storage  # noqa: E402
from forge_ckpt.trainer.ranks import spawn_trainer_ranks  # noqa: E402


@pytest.fixture(scope="module")
def rank_actor(ray_local):
    """The rank actor class; the test helper module travels by value (workers cannot import
    it: it is not installed)."""
    ray_local.cloudpickle.register_pickle_by_value(_trainer_model)
    return ray_local.remote(num_cpus=0)(_trainer_model.TrainerRank)


def call(ranks: list, method: str, *args: Any) -> list:
    """One call per rank, all submitted before waiting: the collectives need every rank."""
    import ray

    return ray.get([getattr(r, method).remote(*args) for r in ranks])


def errors_of(refs: list) -> list[BaseException | None]:
    import ray

    out = []
    for ref in refs:
        try:
            ray.get(ref)
            out.append(None)
        except ray.exceptions.RayTaskError as e:
            out.append(e.cause)
    return out


def new_step(folder: str, step: int) -> str:
    path = layout.step_dir(folder, step)
    os.makedirs(path)  # the coordinator's job in real use
    return path


def save(ranks: list, step_dir: str, background: bool) -> list[list[dict]]:
    call(ranks, "forge_begin_save", step_dir, "", background)
    return wait_saved(ranks)


def wait_saved(ranks: list) -> list[list[dict]]:
    deadline = time.monotonic() + 60
    while True:
        status = call(ranks, "forge_save_status")
        if all(s is not None for s in status):
            return status
        assert time.monotonic() < deadline, "background save did not finish"
        time.sleep(0.05)


def load(ranks, step_dir, records, *, load_optimizer=True, rank_files=True) -> list:
    """prepare on every rank, then apply on every rank (the coordinator's two phases)."""
    flat = [r for recs in records for r in recs]
    refs = [
        rank.forge_prepare_load.remote(
            step_dir,
            flat,
            True,
            {
                "load_optimizer": load_optimizer,
                "rank_file": layout.trainer_rank_file(i) if rank_files else None,
            },
        )
        for i, rank in enumerate(ranks)
    ]
    errors = errors_of(refs)
    if any(errors):
        return errors
    call(ranks, "forge_apply_load")
    return errors


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Bitwise equality through dicts, lists, tensors and arrays."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.flatten().view(torch.uint8), b.flatten().view(torch.uint8)), where
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=where)
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@dataclass
class Run:
    world: int
    folder: str
    ranks: list
    s3: list  # summaries at the sync save of step 3
    records3: list
    probe3: list  # RNG draws right after step 3
    losses_after3: list  # the uninterrupted run's steps 4-6
    s6: list  # summaries when the background save of step 6 began
    rng6: list
    held_status: list  # save_status() while the background write was held
    second_save: list  # errors of a begin_save during the background save
    s7: list  # after the step taken during the background save
    records6: list
    world_info: list
    save_seconds: float


def make_run(world: int, actor_cls: Any, folder: str) -> Run:
    ranks = spawn_trainer_ranks(actor_cls, world)
    call(ranks, "setup")
    call(ranks, "train", 3)
    s3 = call(ranks, "summary")
    t0 = time.monotonic()
    records3 = save(ranks, new_step(folder, 3), background=False)
    save_seconds = time.monotonic() - t0
    probe3 = call(ranks, "probe")
    losses_after3 = call(ranks, "train", 3)

    step6 = new_step(folder, 6)
    call(ranks, "hold_background_writes")
    s6, rng6 = call(ranks, "summary"), call(ranks, "rng_state")
    call(ranks, "forge_begin_save", step6, "", True)
    held_status = call(ranks, "forge_save_status")
    second_save = errors_of([r.forge_begin_save.remote(step6, "", True) for r in ranks])
    call(ranks, "train", 1)  # changes weights, optimizer, LR and RNG mid-save
    s7 = call(ranks, "summary")
    call(ranks, "release_background_writes")
    call(ranks, "train", 1)  # training collectives while DCP's run on the save group
    records6 = wait_saved(ranks)
    world_info = call(ranks, "forge_world_info")
    return Run(**{k: v for k, v in locals().items() if k in Run.__dataclass_fields__})


def _run_fixture(world: int, rank_actor, tmp_path_factory):
    import ray

    run = make_run(world, rank_actor, str(tmp_path_factory.mktemp(f"ckpt-world{world}")))
    yield run
    for r in run.ranks:
        ray.kill(r)


@pytest.fixture(scope="module")
def run1(rank_actor, tmp_path_factory):
    yield from _run_fixture(1, rank_actor, tmp_path_factory)


@pytest.fixture(scope="module")
def run2(rank_actor, tmp_path_factory):
    yield from _run_fixture(2, rank_actor, tmp_path_factory)


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def run(request):
    return request.getfixturevalue(f"run{request.param}")


@pytest.fixture
def fresh(rank_actor):
    """A factory of fresh rank actors (new processes, different initial weights)."""
    import ray

    made = []

    def spawn(world: int) -> list:
        ranks = spawn_trainer_ranks(rank_actor, world)
        made.extend(ranks)
        call(ranks, "setup", 7)
        return ranks

    yield spawn
    for r in made:
        ray.kill(r)


def check_reported_files(step_dir: str, records: list[list[dict]], world: int) -> None:
    for rank, recs in enumerate(records):
        shards = {r["path"] for r in recs if r["path"].endswith(".distcp")}
        assert shards and all(p.startswith(f"__{rank}_") for p in shards)  # DCP's names, per rank
        expected = shards | {layout.trainer_rank_file(rank)}
        expected |= {".metadata"} if rank == 0 else set()
        assert {r["path"] for r in recs} == expected
        for r in recs:  # checksummed while written: equal to what is on disk
            open_storage(step_dir).verify(r["path"], FileRecord.from_dict(r))
    on_disk = {
        os.path.relpath(os.path.join(d, f), step_dir) for d, _, fs in os.walk(step_dir) for f in fs
    }
    assert on_disk == {r["path"] for recs in records for r in recs}
    for rank in range(world):
        content = serialization.load(os.path.join(step_dir, layout.trainer_rank_file(rank)), None)
        assert (content["rank"], content["world_size"]) == (rank, world)


def test_each_rank_reports_its_own_files(run):
    assert run.world_info == [{"rank": r, "world_size": run.world} for r in range(run.world)]
    check_reported_files(layout.step_dir(run.folder, 3), run.records3, run.world)
    check_reported_files(layout.step_dir(run.folder, 6), run.records6, run.world)
    print(f"world {run.world}: sync save of step 3 took {run.save_seconds:.3f}s")


def test_resume_is_bitwise_exact(run, fresh):
    ranks = fresh(run.world)
    assert load(ranks, layout.step_dir(run.folder, 3), run.records3) == [None] * run.world
    for rank, (saved, loaded) in enumerate(zip(run.s3, call(ranks, "summary"), strict=True)):
        assert_same(saved, loaded, f"rank {rank}")
    assert run.s3[0]["moments"], "the optimizer had state to restore"
    assert_same(run.probe3, call(ranks, "probe"), "rng draws")
    assert_same(run.losses_after3, call(ranks, "train", 3), "losses after resume")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_background_save_holds_the_state_of_begin_save(run):
    assert run.held_status == [None] * run.world
    assert all(isinstance(e, CheckpointError) for e in run.second_save)
    changed = run.s6[0]["params"]["0.weight"] != run.s7[0]["params"]["0.weight"]
    assert changed.any(), "the step during the save changed the weights"

    step6 = layout.step_dir(run.folder, 6)
    sd = {k: torch.empty_like(v) for k, v in run.s6[0]["full_params"].items()}
    sd["optimizer"] = {
        f"state.{k}": torch.empty_like(v) for k, v in run.s6[0]["full_moments"].items()
    }
    sd["lr_scheduler"] = {"last_epoch": -1}
    sd["train_state"] = {"step": -1}
    torch.distributed.checkpoint.load(sd, checkpoint_id=step6)  # no process group: reshards
    assert_same(run.s6[0]["full_params"], {k: sd[k] for k in run.s6[0]["full_params"]}, "weights")
    moments = {k.removeprefix("state."): v for k, v in sd["optimizer"].items()}
    assert_same(run.s6[0]["full_moments"], moments, "moments")
    assert sd["lr_scheduler"]["last_epoch"] == run.s6[0]["last_epoch"] == 6
    assert sd["train_state"]["step"] == 6
    for rank in range(run.world):
        saved = serialization.load(os.path.join(step6, layout.trainer_rank_file(rank)), None)
        assert_same(run.rng6[rank]["torch_cpu"], saved["rng"]["torch_cpu"], "torch rng")
        assert_same(run.rng6[rank]["numpy"][1], saved["rng"]["numpy"][1], "numpy rng")
        assert_same(
            run.rng6[rank]["generators"]["data"]["state"],
            saved["rng"]["generators"]["data"]["state"],
            "data generator",
        )


def test_corrupt_files_are_refused_before_dcp_opens_them(run2, tmp_path):
    ranks, records = run2.ranks, run2.records3
    before = call(ranks, "summary")
    step = str(tmp_path / "step-3")
    shutil.copytree(layout.step_dir(run2.folder, 3), step)
    meta = os.path.join(step, ".metadata")
    good = open(meta, "rb").read()

    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0x01
    open(meta, "wb").write(flipped)
    for err in load(ranks, step, records):  # every rank unpickles .metadata: every rank checks
        assert isinstance(err, CheckpointCorruptError) and err.path == meta

    marker = tmp_path / "unpickled"
    open(meta, "wb").write(pickle.dumps(_Hostile(str(marker))))
    for err in load(ranks, step, records):
        assert isinstance(err, CheckpointCorruptError) and err.path == meta
    assert not marker.exists(), "a hostile .metadata was unpickled"

    open(meta, "wb").write(good)
    shard = os.path.join(step, "__1_0.distcp")
    os.truncate(shard, os.path.getsize(shard) - 1)
    errors = load(ranks, step, records)
    assert errors[0] is None  # shard 1 is checked by rank 1 only
    assert isinstance(errors[1], CheckpointCorruptError) and errors[1].path == shard
    assert "size" in str(errors[1])

    call(ranks, "forge_abort_load")
    for err in errors_of([r.forge_apply_load.remote() for r in ranks]):
        assert isinstance(err, CheckpointError)  # nothing staged after abort
    assert_same(before, call(ranks, "summary"), "state after refused loads")


def test_background_failure_is_reported_then_saving_works_again(run2, tmp_path):
    ranks = run2.ranks
    call(ranks, "inject_fault", "write:ENOSPC")  # the rank files fail, after DCP's shards
    try:
        call(ranks, "forge_begin_save", new_step(str(tmp_path), 9), "", True)
        errors = [status_error(r) for r in ranks]
    finally:
        call(ranks, "inject_fault", None)
    assert all(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in errors), errors
    for err in errors_of([r.forge_save_status.remote() for r in ranks]):
        assert isinstance(err, CheckpointError)  # reported once; no save is pending now
    step = new_step(str(tmp_path), 10)
    check_reported_files(step, save(ranks, step, background=True), 2)


def status_error(rank) -> BaseException | None:
    """Poll one rank's save_status until it reports files or raises."""
    import ray

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if ray.get(rank.forge_save_status.remote()) is not None:
                return None
        except ray.exceptions.RayTaskError as e:
            return e.cause
        time.sleep(0.05)
    raise AssertionError("save_status neither finished nor failed")


class _Hostile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_weights_only_load_keeps_the_fresh_optimizer(run1, fresh):
    ranks = fresh(1)
    (before,) = call(ranks, "summary")
    assert before["moments"] == {}
    step3 = layout.step_dir(run1.folder, 3)
    assert load(ranks, step3, run1.records3, load_optimizer=False, rank_files=False) == [None]
    (after,) = call(ranks, "summary")
    assert_same(run1.s3[0]["params"], after["params"], "weights")
    assert after["moments"] == {}, "optimizer moments stay fresh"
    assert after["last_epoch"] == 3 and after["lr"] == after["last_lr"] == run1.s3[0]["last_lr"]
    (losses,) = call(ranks, "train", 1)
    assert np.isfinite(losses).all()


def test_a_one_rank_trainer_saves_without_dcps_collectives(run1, run2, tmp_path):
    """Over a group of one, DCP's collectives pickle every plan and result through gloo and
    back for nothing: a quarter of a small trainer's save. A one-rank trainer saves without
    them (DCP's `no_dist`; the files are the same, as the loads here and stock TorchTitan's
    show); two ranks still coordinate their plans."""
    for run, expect_none in ((run1, True), (run2, False)):
        step_dir = new_step(str(tmp_path / f"world{run.world}"), 90)
        counts = call(run.ranks, "object_collectives_of_a_save", step_dir)
        assert (counts == [0]) if expect_none else all(c > 0 for c in counts), counts
        wait_saved(run.ranks)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:To get the last learning rate")  # TorchTitan's LR load
def test_stock_torchtitan_loads_our_step(run1, run2):
    """Stock TorchTitan pointed at our folder, in this process (which never held the trainer
    state: the ranks are other processes), loads model, optimizer and LR schedule; the world-2
    shards reshard into one unsharded model."""
    for run in (run1, run2):
        got = _trainer_model.StockLoader().load(run.folder, 3)
        assert got["loaded"] is True
        assert_same(run.s3[0]["full_params"], got["full_params"], f"world {run.world}")
        assert_same(run.s3[0]["full_moments"], got["full_moments"], f"world {run.world}")
        assert got["last_epoch"] == 3
