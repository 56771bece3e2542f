"""Local storage's verified read into fresh memory (`read_buffer`, the actor files' path).

The buffer is an anonymous map whose pages are made one read chunk at a time, just before
the chunk is read into them (MADV_POPULATE_WRITE): the bytes read are the file's, damage is
still found, and a kernel without that advice (before 5.14) still gets a correct read, the
pages then faulted in by the read itself.
"""

from __future__ import annotations

import mmap
import os

import pytest

from forge_ckpt import CheckpointCorruptError
from forge_ckpt.storage import local, open_storage

MIB = 1024 * 1024


def test_a_read_of_many_chunks_is_the_file(tmp_path):
    store = open_storage(str(tmp_path))
    data = os.urandom(2 * local.HASHED_CHUNK + 5)  # two whole chunks and a partial one
    rec = store.write("f", data)
    buf = store.read_buffer("f", rec)
    assert bytes(buf) == data and not buf.readonly
    damaged = bytearray(data)
    damaged[-2] ^= 0x10  # in the last, partial chunk
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
