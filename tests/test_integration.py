"""The whole library at once, on CPU with Ray: a trainer of 2 gloo ranks (FSDP2, TorchTitan's
CheckpointManager, AdamW, warmup LR) and three actors (one with 2 replicas, one plain async
actor) save at several steps; fresh actors load; every parameter, optimizer moment, LR, RNG
stream and actor value is bitwise equal to what was saved, and the run goes on exactly as the
uninterrupted run did."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
import ray
import torch

from forge_ckpt import CheckpointConfig, CheckpointCoordinator, spawn_trainer_ranks

sys.path.insert(0, os.path.dirname(__file__))
import _trainer_model  # noqa: E402
from test_coordinator import Sampler, Stats  # noqa: E402

WORLD = 2


def equal(a, b) -> bool:
    """Bitwise equality of nested results (tensors compared by bytes)."""
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "dtype") and hasattr(a, "tobytes"):  # numpy
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    return a == b


async def gather(handles, method, *args):
    return await asyncio.gather(*(getattr(h, method).remote(*args) for h in handles))


class Job:
    def __init__(self, rank_cls, folder: str, seed: int, options: dict | None = None):
        self.ranks = spawn_trainer_ranks(rank_cls, WORLD)
        ray.get([r.setup.remote(seed) for r in self.ranks])
        self.actors = [Sampler.remote(seed), Sampler.remote(seed + 1), Sampler.remote(seed + 2)]
        self.stats = Stats.remote()
        cfg = CheckpointConfig(folder=folder, keep_last=2, storage_options=options or {})
        self.coord = CheckpointCoordinator(cfg)
        self.coord.set_trainer(self.ranks)
        self.coord.register("dataset", self.actors[0])
        self.coord.register("replay_buffer", self.actors[1:])
        self.coord.register("reward", self.stats)

    async def step(self):
        losses = await gather(self.ranks, "train", 1)
        draws = await gather(self.actors, "step")
        await self.stats.add.remote(float(sum(map(sum, draws))))
        return losses, draws

    async def state(self):
        return {
            "trainer": await gather(self.ranks, "summary"),
            "rng": await gather(self.ranks, "rng_state"),
            "actors": await gather(self.actors, "get"),
            "stats": await self.stats.get.remote(),
        }

    def kill(self):
        self.coord.close()
        for h in [*self.ranks, *self.actors, self.stats]:
            ray.kill(h)


@pytest.fixture(scope="module")
def rank_cls(ray_local):
    ray_local.cloudpickle.register_pickle_by_value(_trainer_model)
    return ray_local.remote(num_cpus=0)(_trainer_model.TrainerRank)


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    """A local folder, or a folder on the test's real S3 server (SeaweedFS)."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), {}
    s3 = request.getfixturevalue("s3_folder")
    return s3.url, s3.options


async def test_two_rank_trainer_and_actors_resume_bitwise(rank_cls, where):
    folder, options = where
    job = Job(rank_cls, folder, seed=0, options=options)
    expected = []  # what the uninterrupted run does after step 4
    for step in range(1, 7):
        outcome = await job.step()
        if step > 4:
            expected.append(outcome)
        if step % 2 == 0:
            result = await job.coord.save(step, extra={"step": step})
            assert result.committed
            assert set(result.seconds) == {"trainer", "dataset", "replay_buffer", "reward"}
        if step == 4:
            saved = await job.state()
    expected_probe = await gather(job.ranks, "probe")
    assert job.coord.steps() == [4, 6]
    job.kill()

    fresh = Job(rank_cls, folder, seed=11, options=options)  # all of it must be restored
    loaded = await fresh.coord.load(step=4)
    assert loaded.step == 4 and loaded.extra == {"step": 4}
    got = await fresh.state()
    for key in ("trainer", "rng", "actors", "stats"):
        assert equal(got[key], saved[key]), f"{key} differs after load"
    resumed = [await fresh.step() for _ in range(2)]
    assert equal(resumed, expected)  # losses of both ranks and every actor draw
    assert equal(await gather(fresh.ranks, "probe"), expected_probe)
    fresh.kill()
    if folder.startswith("s3://"):
        stock_dcp_reads_the_s3_step(f"{folder}/step-4", options, saved["trainer"][0])


def stock_dcp_reads_the_s3_step(url: str, options: dict, summary: dict) -> None:
    """DCP's own fsspec reader (s3fs underneath) loads our S3 step: the files are standard."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # stock DCP
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    fs_opts = {
        "key": options["aws_access_key_id"],
        "secret": options["aws_secret_access_key"],
        "client_kwargs": {"endpoint_url": options["endpoint_url"], "region_name": "us-east-1"},
    }
    reader = FsspecReader(url, **fs_opts)
    meta = reader.read_metadata()
    names = list(summary["full_params"])
    sd = {}
    for n in names:
        md = meta.state_dict_metadata[n]
        assert isinstance(md, TensorStorageMetadata)
        sd[n] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load(sd, storage_reader=FsspecReader(url, **fs_opts), no_dist=True)
    for n in names:
        assert equal(sd[n], summary["full_params"][n]), n
