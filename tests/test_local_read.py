"""Local storage's verified read into fresh memory (`read_buffer`, the actor files' path).

The buffer is an anonymous map whose pages are made up front (huge pages where the kernel
gives them), with the disk asked for the first `PREFETCH` bytes before that: the bytes read
are the file's, damage is still found, and a kernel without MADV_POPULATE_WRITE (before
5.14) still gets a correct read, the pages then faulted in by the read itself.
"""

from __future__ import annotations

import mmap
import os

import pytest

from forge_ckpt import CheckpointCorruptError
from forge_ckpt.storage import local, open_storage

MIB = 1024 * 1024


def test_a_big_read_past_the_prefetch_window_is_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "PREFETCH", MIB)  # the window ends well inside the file
    store = open_storage(str(tmp_path))
    data = os.urandom(9 * MIB + 5)
    rec = store.write("f", data)
    buf = store.read_buffer("f", rec)
    assert bytes(buf) == data and not buf.readonly
    damaged = bytearray(data)
    damaged[-2] ^= 0x10  # past the window: found by the checksum all the same
    (tmp_path / "f").write_bytes(damaged)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch") as e:
        store.read_buffer("f", rec)
    assert e.value.path.endswith("f")


def test_a_kernel_refusing_the_populate_advice_still_reads_correctly(tmp_path, monkeypatch):
    # An advice number no kernel knows: madvise fails with EINVAL, as MADV_POPULATE_WRITE
    # does before Linux 5.14.
    monkeypatch.setattr(local, "MADV_POPULATE_WRITE", 0x7FFF)
    with mmap.mmap(-1, MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as m:
        with pytest.raises(OSError):
            m.madvise(local.MADV_POPULATE_WRITE)
    store = open_storage(str(tmp_path))
    data = os.urandom(local.MAP_MIN + 7)
    rec = store.write("f", data)
    assert bytes(store.read_buffer("f", rec)) == data
    assert bytes(store.read_buffer("f")) == data  # unverified: no checksum on the way
