"""A trainer rank's late DCP write (docs/protocol.md, rule 9): a rank of a job that lost the
lease, held while it wrote step 2 (a stalled process, a slow disk), finishes after the
successor removed that leftover step and saved its own step 2. Invariant I1 (nothing
committed is lost): the late finish must not delete or replace the successor's `.metadata`.

DCP's own finish writes `.metadata.tmp`, deletes any `.metadata` and renames over it; the
SeamWriter creates `.metadata` once, create-only, so the late one fails and the successor's
step loads as it was saved. Real DCP saves over a real local folder; the stale rank's finish
is held on an Event in its own thread.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from forge_ckpt import CheckpointCorruptError
from forge_ckpt.dcp.metadata import check_complete, load_metadata
from forge_ckpt.dcp.storage_io import METADATA, SeamReader, SeamWriter
from forge_ckpt.storage import open_storage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class HeldWriter(SeamWriter):
    """A's rank: its shards are written, its finish waits for `go`."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.reached, self.go = threading.Event(), threading.Event()

    def finish(self, metadata: Any, results: Any) -> None:
        self.reached.set()
        assert self.go.wait(120)
        super().finish(metadata, results)


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}


def test_a_stale_ranks_late_finish_never_replaces_the_successors_metadata(tmp_path: Path):
    folder = tmp_path / "step-2"
    folder.mkdir()
    store = open_storage(str(folder))
    stale = HeldWriter(store)
    errors: list[BaseException] = []

    def a_saves() -> None:
        try:
            dcp.save(state(1), storage_writer=stale, no_dist=True)
        except BaseException as e:  # noqa: BLE001 (what A's rank raised, asserted below)
            errors.append(e)

    a = threading.Thread(target=a_saves)
    a.start()
    try:
        assert stale.reached.wait(120)  # A's shards are written; its finish is held
        for p in folder.iterdir():  # the successor removes the uncommitted leftover ...
            p.unlink()
        successor = SeamWriter(store)
        dcp.save(state(2), storage_writer=successor, no_dist=True)  # ... and saves its own
        records = {r.path: r for r in successor.records}  # what its manifest records
        saved = (folder / METADATA).read_bytes()
    finally:
        stale.go.set()  # A's finish lands late
        a.join(120)
    print(f"A's late finish raised: {errors and repr(errors[0])[:200]}")
    assert errors, "the stale rank's finish succeeded over the successor's step"
    assert (folder / METADATA).read_bytes() == saved  # not deleted, not replaced
    assert sorted(p.name for p in folder.iterdir() if "tmp" in p.name) == []
    out = {k: torch.zeros_like(v) for k, v in state(0).items()}
    dcp.load(out, storage_reader=SeamReader(store, records), no_dist=True)  # verified
    for k, v in state(2).items():
        assert torch.equal(out[k], v), k


@pytest.mark.parametrize("reader", ["stock", "seam"])
def test_a_step_written_this_way_loads_with_stock_dcp(tmp_path: Path, reader: str):
    """`.metadata` written without DCP's temp file and rename is still what stock DCP reads."""
    store = open_storage(str(tmp_path))
    writer = SeamWriter(store)
    dcp.save(state(3), storage_writer=writer, no_dist=True)
    out = {k: torch.zeros_like(v) for k, v in state(0).items()}
    if reader == "stock":
        dcp.load(out, checkpoint_id=str(tmp_path), no_dist=True)
    else:
        records = {r.path: r for r in writer.records}
        dcp.load(out, storage_reader=SeamReader(store, records), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in state(3).items())


@pytest.mark.parametrize("late", ["__0_0.distcp", "__0_1.distcp"])
def test_a_file_that_fails_in_a_dcp_writer_thread_fails_the_save(tmp_path: Path, late: str):
    """Review 20, claim 1: DCP writes files in helper threads beside the caller's and only
    prints a helper's error. A stale rank's late data file met the successor's create-only
    write there, and the successor's save returned without that file: it committed a step
    whose `.metadata` lacked those items (a step that could not be loaded). Both files are
    tried, so whichever thread writes it, the save must fail and name the file."""
    store = open_storage(str(tmp_path))
    store.write(late, b"a stale rank's late bytes", exclusive=True)
    writer = SeamWriter(store, thread_count=2)
    big = {f"t{i}": torch.full((4096,), float(i)) for i in range(8)}  # two files of 4 items
    with pytest.raises(CheckpointException, match=f"{late} already exists") as e:
        dcp.save(big, storage_writer=writer, no_dist=True)
    print(f"\n{late}: {str(e.value)[:300]}")
    assert not (tmp_path / METADATA).exists()  # nothing for a commit to vouch for


def test_metadata_without_an_items_data_is_a_damaged_step(tmp_path: Path):
    """Defense in depth for the above: a `.metadata` that records no data for an item, or
    puts it in a file the manifest does not list, is refused while preparing (a damaged
    step, which `fallback` passes over), not halfway through DCP's apply."""
    store = open_storage(str(tmp_path))
    writer = SeamWriter(store)
    dcp.save(state(4), storage_writer=writer, no_dist=True)
    listed = {r.path for r in writer.records}
    metadata = load_metadata((tmp_path / METADATA).read_bytes(), METADATA)
    check_complete(metadata, listed, METADATA)  # as written: complete
    with pytest.raises(CheckpointCorruptError, match="does not list"):
        check_complete(metadata, listed - {"__0_1.distcp"}, METADATA)
    metadata.storage_data.pop(next(iter(metadata.storage_data)))
    with pytest.raises(CheckpointCorruptError, match="records no data for"):
        check_complete(metadata, listed, METADATA)
