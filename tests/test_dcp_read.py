"""`dcp_read` / `tensor_blob`: DCP items read straight into their destination tensors.

Files written by forge_ckpt's SeamWriter and by stock DCP load through SeamReader equal to
what was saved, into the very tensors given (no new storage), without `torch.load` for any
tensor item; damage is found and names the file, a truncated file is refused before any
destination changes; a blob that is not a plain tensor (or a pickle naming anything else) is
left to `torch.load` and nothing in it runs.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter

from forge_ckpt import CheckpointCorruptError
from forge_ckpt.dcp import tensor_blob
from forge_ckpt.dcp.storage_io import SeamReader, SeamWriter, verify_local
from forge_ckpt.storage import FileRecord, open_storage

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(512, 256, generator=g),  # > dcp_read.SMALL: read into place
        "big_bf16": torch.randn(300_000, generator=g).to(torch.bfloat16),
        "ints": torch.arange(100_000, dtype=torch.int64),
        "mask": torch.rand(1000, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(400, 300, generator=g).t(),  # saved non-contiguous
        "small": torch.randn(7, generator=g),
    }


def _zeros(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}


def _save_seam(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, FileRecord]]:
    sd = _state()
    folder.mkdir(parents=True, exist_ok=True)
    writer = SeamWriter(open_storage(str(folder)))
    dcp.save(sd, storage_writer=writer, no_dist=True)
    return sd, {r.path: r for r in writer.records}


def _load(folder: Path, target: dict, expected: dict[str, FileRecord], **kw: object) -> None:
    reader = SeamReader(open_storage(str(folder)), expected, {}, **kw)  # type: ignore[arg-type]
    try:
        dcp.load(target, storage_reader=reader, no_dist=True)
    except CheckpointException as e:  # DCP wraps every rank's error
        raise next(iter(e.failures.values()))[0] from None


@pytest.mark.parametrize("writer", ["seam", "stock"])
def test_loads_into_the_given_tensors_without_torch_load(tmp_path, monkeypatch, writer):
    if writer == "seam":
        sd, expected = _save_seam(tmp_path)
    else:
        sd, expected = _state(), {}
        dcp.save(sd, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    target = _zeros(sd)
    pointers = {k: v.data_ptr() for k, v in target.items()}
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(1) or real_load(*a, **k))
    _load(tmp_path, target, expected)
    for k, v in sd.items():
        assert torch.equal(target[k], v), k
        assert target[k].data_ptr() == pointers[k], k
    assert calls == []


def test_a_flipped_byte_is_found_and_named(tmp_path):
    _, expected = _save_seam(tmp_path)
    shard = next(p for p in expected if p.endswith(".distcp"))
    path = tmp_path / shard
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(data)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch") as e:
        _load(tmp_path, _zeros(_state()), expected)
    assert e.value.path.endswith(shard)


def test_a_truncated_file_is_refused_before_anything_is_read(tmp_path):
    sd, expected = _save_seam(tmp_path)
    shards = sorted(p for p in expected if p.endswith(".distcp"))
    with open(tmp_path / shards[-1], "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / shards[-1]) - 1)
    target = _zeros(sd)
    with pytest.raises(CheckpointCorruptError, match="truncated or replaced"):
        _load(tmp_path, target, expected)
    assert all(not v.any() for v in target.values())  # no destination was written


def test_a_file_replaced_after_its_check_is_checked_again(tmp_path):
    _, expected = _save_seam(tmp_path / "a")
    store = open_storage(str(tmp_path / "a"))
    shard = next(p for p in sorted(expected) if p.endswith(".distcp"))
    seen = {shard: verify_local(store, shard, expected[shard])}
    assert seen[shard] is not None
    other = {k: torch.ones_like(v) for k, v in _state().items()}  # same sizes, other bytes
    (tmp_path / "b").mkdir()
    dcp.save(other, storage_writer=SeamWriter(open_storage(str(tmp_path / "b"))), no_dist=True)
    os.replace(tmp_path / "b" / shard, tmp_path / "a" / shard)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        _load(tmp_path / "a", _zeros(_state()), expected, seen=seen)


def _blob(obj: object) -> memoryview:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return memoryview(buf.getvalue())


def _parse(blob: memoryview) -> tensor_blob.TensorBlob | None:
    records = tensor_blob.central_directory(blob[-tensor_blob.TAIL :], len(blob))
    return None if records is None else tensor_blob.parse(blob, records, len(blob))


def test_tensor_blob_reads_a_plain_tensor_layout():
    t = torch.arange(24, dtype=torch.int16).reshape(2, 3, 4)
    got = _parse(_blob(t))
    assert got is not None and got.contiguous_whole()
    assert (got.dtype, got.size, got.stride, got.nbytes) == (torch.int16, (2, 3, 4), (12, 4, 1), 48)
    blob = _blob(t)
    data = bytes(blob[got.data_start : got.data_start + got.nbytes])
    assert data == t.numpy().tobytes()
    view = _parse(_blob(torch.arange(10.0)[2:5]))  # a view: the whole storage is saved
    assert view is not None and not view.contiguous_whole() and view.storage_offset == 2


class _Planted:
    def __reduce__(self):  # what a hostile data.pkl would hold
        return (os.system, ("echo planted > /dev/null",))


def test_tensor_blob_leaves_other_pickles_to_torch_load(monkeypatch):
    assert _parse(_blob(nn.Parameter(torch.ones(3)))) is None  # another rebuild function
    blob = bytearray(_blob(torch.ones(3)))
    pkl = pickle.dumps(_Planted(), protocol=2)
    assert _parse(_blob({"a": 1})) is None
    ran = []
    monkeypatch.setattr(os, "system", lambda *a: ran.append(a) or 0)
    records = tensor_blob.central_directory(memoryview(blob)[-tensor_blob.TAIL :], len(blob))
    assert records is not None
    name = next(n for n in records if n.endswith("/data.pkl"))
    start = tensor_blob.data_offset(memoryview(blob), records[name])
    assert start is not None
    size = records[name].size
    planted = pkl[:size].ljust(size, b".")  # the same length, so the zip layout holds
    blob[start : start + size] = planted
    assert tensor_blob.parse(memoryview(blob), records, len(blob)) is None
    assert ran == []
