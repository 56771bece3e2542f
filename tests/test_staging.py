"""The trainer's snapshot buffers: a private copy, reused between saves, DTensors kept whole."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from forge_ckpt.trainer.staging import SnapshotBuffers


def state() -> dict:
    return {
        "model.w": torch.randn(4, 3),
        "optimizer": {"state": {"w": {"exp_avg": torch.randn(4, 3), "step": torch.tensor(3.0)}}},
        "param_groups": [{"lr": 0.1, "params": ["w"]}],
        "pair": (torch.arange(5)[1:4], "x"),
        "kind": torch.optim.AdamW,  # a class object: what broke torch 2.11's stager on reuse
        "nothing": None,
    }


def flat(obj, out=None, path=()):
    out = {} if out is None else out
    if isinstance(obj, dict):
        for k, v in obj.items():
            flat(v, out, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            flat(v, out, (*path, i))
    else:
        out[path] = obj
    return out


def test_copy_is_private_and_equal():
    src = state()
    snap = SnapshotBuffers().copy(src)
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in flat(src).items()}
    for t in (src["model.w"], src["optimizer"]["state"]["w"]["exp_avg"]):
        t.add_(1.0)  # training goes on after save() returned
    src["param_groups"][0]["lr"] = 0.5
    got = flat(snap)
    assert got.keys() == before.keys()
    for k, v in before.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v) and got[k].dtype == v.dtype, k
        else:
            assert got[k] == v, k
    assert isinstance(snap["pair"], tuple) and snap["kind"] is torch.optim.AdamW


def test_buffers_are_reused_until_a_shape_changes():
    buffers = SnapshotBuffers()
    src = state()
    first = flat(buffers.copy(src))
    src["model.w"].mul_(2)
    second = flat(buffers.copy(src))
    for k, v in first.items():
        if isinstance(v, torch.Tensor):
            assert second[k].data_ptr() == v.data_ptr(), k
    assert torch.equal(second[("model.w",)], src["model.w"])
    nbytes = buffers.nbytes
    src["model.w"] = torch.randn(8, 3)
    third = flat(buffers.copy(src))
    assert third[("model.w",)].data_ptr() != second[("model.w",)].data_ptr()
    assert buffers.nbytes == nbytes + 4 * 3 * 4


def test_dtensor_stays_a_dtensor_with_its_layout(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = torch.randn(6, 4)
        dt = distribute_tensor(full, mesh, [Shard(0)])
        snap = SnapshotBuffers().copy({"w": dt})["w"]
        dt.to_local().zero_()
        assert isinstance(snap, DTensor)
        assert snap.placements == dt.placements and snap.device_mesh == mesh
        assert snap.shape == dt.shape and snap.stride() == dt.stride()
        assert torch.equal(snap.to_local(), full)
    finally:
        dist.destroy_process_group()
