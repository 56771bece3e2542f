"""forge_ckpt's DCP writer turns torch.save's zip CRC32 off while it writes (our CRC32C covers
every byte), stock DCP still loads the files, and the user's setting comes back after."""

from __future__ import annotations

import io
import threading
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.utils.serialization import config

from forge_ckpt.dcp import zip_crc
from forge_ckpt.dcp.metadata import load_metadata
from forge_ckpt.dcp.storage_io import SavePlanner, SeamWriter
from forge_ckpt.storage import open_storage

STATE = {f"w{i}": torch.randn(1000 + i) for i in range(4)}


def _save(folder: Path) -> None:
    folder.mkdir()
    dcp.save(STATE, storage_writer=SeamWriter(open_storage(str(folder))), no_dist=True)


def _records(folder: Path) -> list[zipfile.ZipInfo]:
    """The zip records of every tensor item (each item is one torch.save zip)."""
    md = load_metadata((folder / ".metadata").read_bytes(), str(folder))
    out = []
    for info in md.storage_data.values():
        data = (folder / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            out += [r for r in z.infolist() if "/data/" in r.filename]
    return out


def _loads_with_stock_dcp(folder: Path) -> None:
    out = {k: torch.empty_like(v) for k, v in STATE.items()}
    dcp.load(out, checkpoint_id=folder, no_dist=True)  # DCP's own FileSystemReader
    assert all(torch.equal(out[k], v) for k, v in STATE.items())


def test_records_carry_no_zip_crc_and_stock_dcp_loads_them(tmp_path: Path) -> None:
    assert config.save.compute_crc32
    _save(tmp_path / "step")
    records = _records(tmp_path / "step")
    assert len(records) == len(STATE) and all(r.CRC == 0 for r in records)
    assert config.save.compute_crc32  # restored once the write ended
    _loads_with_stock_dcp(tmp_path / "step")


def test_the_environment_keeps_torchs_crc(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FORGE_CKPT_ZIP_CRC32", "1")
    _save(tmp_path / "step")
    records = _records(tmp_path / "step")
    assert records and all(r.CRC != 0 for r in records)
    _loads_with_stock_dcp(tmp_path / "step")


def _crcs() -> list[int]:
    """The zip CRC32 fields of a fresh `torch.save` made in the calling thread."""
    buf = io.BytesIO()
    torch.save(torch.randn(100), buf)
    with zipfile.ZipFile(buf) as z:
        return [r.CRC for r in z.infolist()]


def test_only_the_writing_thread_is_affected_and_its_setting_comes_back() -> None:
    if not zip_crc.PER_THREAD:
        pytest.skip("this torch keeps compute_crc32 process-wide: forge_ckpt leaves it alone")
    other: list[list[int]] = []
    with zip_crc.off():
        assert not any(_crcs())
        t = threading.Thread(target=lambda: other.append(_crcs()))  # the job's own thread
        t.start()
        t.join(30)
    assert other and all(other[0]) and all(_crcs())
    config.save.compute_crc32 = False  # the user's own choice (monkeypatch would delete
    try:  # torch's config entry on undo)
        with zip_crc.off():
            pass
        assert config.save.compute_crc32 is False
    finally:
        config.save.compute_crc32 = True


@pytest.mark.parametrize("value", ["", "0"])
def test_unset_or_zero_turns_it_off(monkeypatch, value: str) -> None:
    monkeypatch.setenv("FORGE_CKPT_ZIP_CRC32", value)
    assert not zip_crc.kept()


def _item_crcs(folder: Path) -> list[int]:
    """The zip CRC32 fields of every item (tensors and small values) DCP wrote."""
    md = load_metadata((folder / ".metadata").read_bytes(), str(folder))
    out = []
    for info in md.storage_data.values():
        data = (folder / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            out += [r.CRC for r in z.infolist() if r.filename.endswith("data.pkl")]
    return out


def test_small_values_saved_without_crc_never_reach_a_save_that_keeps_it(
    tmp_path: Path, monkeypatch
) -> None:
    """SavePlanner keeps the torch.save bytes of small values for the process; made while
    the CRC was off, they went into every later save: one that keeps the CRC
    (FORGE_CKPT_ZIP_CRC32=1), and a user's stock FileSystemWriter save (review 33)."""
    state = {"lr": 1e-3, "betas": (0.9, 0.95), "w": torch.ones(4)}
    (tmp_path / "ours").mkdir()
    dcp.save(state, storage_writer=SeamWriter(open_storage(str(tmp_path / "ours"))), no_dist=True,
             planner=SavePlanner())  # fmt: skip
    assert not any(_item_crcs(tmp_path / "ours"))
    stock = FileSystemWriter(tmp_path / "stock", sync_files=False)
    dcp.save(state, storage_writer=stock, planner=SavePlanner(), no_dist=True)
    assert all(_item_crcs(tmp_path / "stock"))
    monkeypatch.setenv("FORGE_CKPT_ZIP_CRC32", "1")
    (tmp_path / "kept").mkdir()
    dcp.save(state, storage_writer=SeamWriter(open_storage(str(tmp_path / "kept"))), no_dist=True,
             planner=SavePlanner())  # fmt: skip
    assert all(_item_crcs(tmp_path / "kept"))
