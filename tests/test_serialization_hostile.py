"""Malformed and hostile state files: every one must give CheckpointCorruptError, nothing else.

Files are built by hand (magic, u64 header length, msgpack header, padding, data) so that each
test targets one check of the decoder.
"""

from __future__ import annotations

import os
import pickle
import struct
import tempfile
import tracemalloc
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forge_ckpt.errors import CheckpointCorruptError
from forge_ckpt.serialization import (
    EXT_BIGINT,
    EXT_DTYPE,
    EXT_NDARRAY,
    EXT_NPSCALAR,
    EXT_SIZE,
    EXT_TENSOR,
    EXT_TUPLE,
    MAGIC,
    describe,
    load,
    loads,
    snapshot,
)

Ext = msgpack.ExtType
TUPLE = Ext(EXT_TUPLE, b"")


def image(header: bytes, data: bytes = b"", *, hlen: int | None = None, pad: bool = True) -> bytes:
    """A file image around a raw msgpack header; data starts at the next 64-byte boundary."""
    hlen = len(header) if hlen is None else hlen
    head = MAGIC + struct.pack("<Q", hlen) + header
    if pad:
        head += bytes(-len(head) % 64)
    return head + data


def obj(tree, data: bytes = b"") -> bytes:
    return image(msgpack.packb(tree, use_bin_type=True), data)


def blob(code: int, dtype, shape, offset: int, nbytes: int) -> Ext:
    return Ext(code, msgpack.packb([dtype, shape, offset, nbytes]))


def corrupt(img: bytes, match: str | None = None, tmp_path: Path | None = None):
    """Assert that loads (and load/describe on a file) reject `img` with CheckpointCorruptError."""
    with pytest.raises(CheckpointCorruptError, match=match) as info:
        loads(img, path="f.bin")
    assert info.value.path == "f.bin"
    if tmp_path is not None:
        p = str(tmp_path / "f.bin")
        Path(p).write_bytes(img)
        with pytest.raises(CheckpointCorruptError, match=match):
            load(p)
    return info.value


def valid_image() -> bytes:
    state = {
        "t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "a": np.arange(5, dtype=np.int32),
        "tuple": (1, (2.5, "x")),
        "big": 2**100,
        "scalar": np.float32(3.0),
        "size": torch.Size([2]),
        "dtype": torch.float16,
        "keys": {1: None, (1, "a"): b"b", 2.5: True},
    }
    with tempfile.TemporaryDirectory() as d:
        snapshot(state, name="v").write(os.path.join(d, "f"), "f")
        return Path(d, "f").read_bytes()


VALID = valid_image()


def test_valid_image_loads():
    out = loads(VALID)
    assert out["tuple"] == (1, (2.5, "x")) and out["big"] == 2**100


# ---------------------------------------------------------------- preamble


@pytest.mark.parametrize(
    "img, match",
    [
        (b"", "too short"),
        (MAGIC, "too short"),
        (b"PK\x03\x04" + bytes(60), "not a forge_ckpt state file"),
        (b"FCKPT\x00\x02\n" + VALID[8:], "not a forge_ckpt state file"),
        (MAGIC + struct.pack("<Q", 10**6) + b"\x80", "does not fit"),
        (MAGIC + struct.pack("<Q", 2**64 - 1) + bytes(100), "does not fit"),
        (image(b"\x80", pad=False), "does not fit"),  # no room for the data section
        (VALID[:20], "does not fit"),  # truncated inside the header
    ],
)
def test_bad_preamble(tmp_path, img, match):
    corrupt(img, match, tmp_path)


def test_describe_rejects_bad_files(tmp_path):
    for img in (b"junk", image(b"\xc1"), obj([Ext(99, b"")])):
        p = tmp_path / "f.bin"
        p.write_bytes(img)
        with pytest.raises(CheckpointCorruptError):
            describe(str(p))
    with pytest.raises(CheckpointCorruptError, match="missing"):
        describe(str(tmp_path / "nope"))


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointCorruptError, match="missing"):
        load(str(tmp_path / "nope"))


# ---------------------------------------------------------------- msgpack structure


@pytest.mark.parametrize(
    "header",
    [
        b"\xc1",  # reserved, never used
        b"\x92\x01",  # array of 2 with 1 item
        msgpack.packb({"a": list(range(100))})[:-7],  # truncated
        b"\x01\x02",  # extra data after the object
        b"\xa3\xff\xfe\xfd",  # invalid utf-8
        b"\xdd\xff\xff\xff\xff",  # array declaring 2**32-1 items
        b"\xdf\xff\xff\xff\xff",  # map declaring 2**32-1 pairs
        b"\xdb\xff\xff\xff\xff",  # str of 4 GiB
        b"\xc6\xff\xff\xff\xff",  # bin of 4 GiB
        b"\xc9\xff\xff\xff\xff\x05",  # ext of 4 GiB
        b"\x91" * 10_000 + b"\xc0",  # 10k nested arrays
        b"\x81" * 10_000 + b"\xc0",  # 10k nested maps
        b"\x81\x91\x01\x02",  # list as map key: unhashable
        b"\x81\x81\x01\x02\x03",  # map as map key: unhashable
    ],
    ids=lambda h: h[:6].hex(),
)
def test_bad_msgpack_header(header):
    tracemalloc.start()
    try:
        corrupt(image(header), "bad header")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak} bytes allocated for a tiny header"


def test_huge_declared_lengths_with_padding_do_not_allocate():
    """A header that really is 1 MiB long may not declare a list of 2**32 items."""
    header = b"\xdd\xff\xff\xff\xff" + bytes(1 << 20)
    tracemalloc.start()
    try:
        corrupt(image(header), "bad header")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


@pytest.mark.parametrize(
    "tree, match",
    [
        ([Ext(99, b"x")], "unknown or malformed ext type 99"),
        ([Ext(0, b"")], "ext type 0"),
        ({"k": Ext(127, b"\x00" * 100)}, "ext type 127"),
        ([Ext(EXT_TUPLE, b"x")], "ext type 1"),
        ([Ext(EXT_BIGINT, b"")], "ext type 2"),
        ([Ext(EXT_DTYPE, b"no_such_dtype")], "ext type 6"),
        ([Ext(EXT_DTYPE, b"\xff\xfe")], "ext type 6"),
        ([Ext(EXT_SIZE, msgpack.packb([1, "a"]))], "ext type 7"),
        ([Ext(EXT_SIZE, msgpack.packb({"a": 1}))], "ext type 7"),
        ([Ext(EXT_SIZE, b"\xc1")], "bad header"),
        ([Ext(EXT_NPSCALAR, msgpack.packb(["<f4", b"\x00\x00"]))], "malformed numpy scalar"),
        ([Ext(EXT_NPSCALAR, msgpack.packb(["|O8", bytes(8)]))], "unknown numpy dtype"),
        ([Ext(EXT_NPSCALAR, msgpack.packb(["<f3", bytes(3)]))], "bad header"),
        ([Ext(EXT_NPSCALAR, msgpack.packb("x"))], "malformed numpy scalar"),
        (Ext(EXT_TUPLE, b""), "tuple marker"),  # a bare marker
        ([1, TUPLE], "tuple marker"),  # marker not at the head
        ({"a": TUPLE}, "tuple marker"),
        ([TUPLE, TUPLE], "tuple marker"),
        ({Ext(EXT_TUPLE, b""): 1}, "map key of type object"),
        ({Ext(EXT_NPSCALAR, msgpack.packb(["<f4", bytes(4)])): 1}, "map key of type float32"),
        ({b"bytes": 1}, "map key of type bytes"),
        ({(TUPLE, 1, b"x"): 1}, "map key of type tuple"),
        ({(1, 2): 1}, "bad header: TypeError"),  # array key without the tuple marker
    ],
)
def test_bad_ext_and_keys(tree, match):
    corrupt(obj(tree), match)


def test_timestamp_ext_is_not_an_error_source():
    """msgpack decodes ext -1 (timestamps) itself; it must not crash the loader either."""
    out = loads(image(b"\x91\xd6\xff\x00\x00\x00\x01"))
    assert len(out) == 1
    corrupt(image(b"\x91\xd5\xff\x00\x00"), "bad header")  # malformed timestamp


# ---------------------------------------------------------------- blob descriptors


DATA = bytes(range(256)) * 4  # 1 KiB data section


@pytest.mark.parametrize(
    "ext, match",
    [
        (blob(EXT_TENSOR, "float32", [4], 1024, 16), "outside the data section"),
        (blob(EXT_TENSOR, "float32", [300], 0, 1200), "outside the data section"),
        (blob(EXT_NDARRAY, "<f8", [2**40], 0, 2**43), "outside the data section"),
        (blob(EXT_TENSOR, "float32", [4], 2**63, 16), "outside the data section"),
        (blob(EXT_TENSOR, "float32", [4], 8, 16), "outside the data section"),  # unaligned
        (blob(EXT_TENSOR, "float32", [4], -64, 16), "malformed blob descriptor"),
        (blob(EXT_TENSOR, "float32", [4], 0, -16), "malformed blob descriptor"),
        (blob(EXT_TENSOR, "float32", [4], 0, 12), "does not hold"),
        (blob(EXT_NDARRAY, "<f4", [2, 3], 0, 16), "does not hold"),
        (blob(EXT_TENSOR, "float32", [-1, 4], 0, 16), "malformed blob descriptor"),
        (blob(EXT_TENSOR, "float32", [2**62, 2**62], 0, 16), "malformed blob descriptor"),
        (blob(EXT_TENSOR, "uint8", [2**61, 2**61, 0], 0, 0), "bad header"),
        (blob(EXT_NDARRAY, "|u1", [1] * 65, 0, 1), "malformed blob descriptor"),
        (blob(EXT_TENSOR, "float32", [1.5], 0, 6), "malformed blob descriptor"),
        (blob(EXT_TENSOR, "float32", "ab", 0, 2), "malformed blob descriptor"),
        (blob(EXT_TENSOR, "float32", [4], "0", 16), "malformed blob descriptor"),
        (blob(EXT_TENSOR, "qint8", [4], 0, 4), "unknown tensor dtype"),
        (blob(EXT_TENSOR, "Tensor", [4], 0, 4), "unknown tensor dtype"),
        (blob(EXT_TENSOR, 7, [4], 0, 4), "unknown tensor dtype"),
        (blob(EXT_NDARRAY, "|O8", [1], 0, 8), "unknown numpy dtype"),
        (blob(EXT_NDARRAY, "<U4", [1], 0, 16), "unknown numpy dtype"),
        (blob(EXT_NDARRAY, "|V8", [1], 0, 8), "unknown numpy dtype"),
        (blob(EXT_NDARRAY, "float32", [1], 0, 4), "unknown numpy dtype"),
        (blob(EXT_NDARRAY, "<f4,<f4", [1], 0, 8), "unknown numpy dtype"),
        (Ext(EXT_TENSOR, msgpack.packb(["float32", [4], 0])), "malformed blob descriptor"),
        (Ext(EXT_TENSOR, msgpack.packb({"dtype": "float32"})), "malformed blob descriptor"),
        (Ext(EXT_TENSOR, b"\x94" + b"\x91" * 2000), "bad header"),
        (Ext(EXT_NDARRAY, b"\xc1"), "bad header"),
    ],
)
def test_bad_blob_descriptor(tmp_path, ext, match):
    corrupt(obj({"x": ext}, DATA), match, tmp_path)


def test_good_handmade_blobs_load():
    """The hand-built format helpers agree with the decoder (guards the tests above)."""
    tree = {
        "t": blob(EXT_TENSOR, "int16", [2, 2], 64, 8),
        "a": blob(EXT_NDARRAY, "|u1", [3], 0, 3),
        "e": blob(EXT_TENSOR, "float32", [0, 2**40], 0, 0),
    }
    out = loads(obj(tree, DATA))
    assert out["a"].tolist() == [0, 1, 2]
    assert bytes(out["t"].view(torch.uint8).reshape(-1).tolist()) == DATA[64:72]
    assert out["e"].shape == (0, 2**40)


def test_overlapping_blobs_are_only_views():
    """Two descriptors may point at the same bytes; that is harmless (views, no copies)."""
    tree = [blob(EXT_NDARRAY, "|u1", [4], 0, 4), blob(EXT_NDARRAY, "<u4", [1], 0, 4)]
    a, b = loads(obj(tree, DATA))
    a[0] = 9
    assert b[0] == int.from_bytes(bytes([9, 1, 2, 3]), "little")


# ---------------------------------------------------------------- pickle payloads


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_payloads_are_never_executed(tmp_path):
    marker = str(tmp_path / "pwned")
    payload = pickle.dumps(Evil(marker))
    live = str(tmp_path / "live")  # the payload is real: unpickling it creates its file
    pickle.loads(pickle.dumps(Evil(live))).close()
    assert os.path.exists(live) and not os.path.exists(marker)
    # as a bytes value: comes back as the same plain bytes
    out = loads(obj({"p": payload, "l": [payload]}))
    assert out == {"p": payload, "l": [payload]} and type(out["p"]) is bytes
    # as the whole header, inside ext payloads of every code, inside a blob descriptor
    corrupt(image(payload))
    for code in range(128):
        if code == EXT_BIGINT:  # any bytes are a valid big int: harmless
            assert loads(obj([Ext(code, payload)])) == [
                int.from_bytes(payload, "little", signed=True)
            ]
            continue
        with pytest.raises(CheckpointCorruptError):
            loads(obj([Ext(code, payload)]))
    corrupt(obj([Ext(EXT_NDARRAY, msgpack.packb([payload, [1], 0, 1]))], DATA))
    # as the data section behind a tensor
    t = loads(obj([blob(EXT_TENSOR, "uint8", [len(payload)], 0, len(payload))], payload))[0]
    assert bytes(t.tolist()) == payload
    assert not os.path.exists(marker)


def test_pickle_value_is_refused_at_save(tmp_path):
    from forge_ckpt.errors import NotSerializableError

    with pytest.raises(NotSerializableError, match="type Evil is not serializable"):
        snapshot({"e": Evil(str(tmp_path / "m"))}, name="c")


# ---------------------------------------------------------------- fuzzing


def _only_corrupt_errors(img: bytes) -> None:
    try:
        loads(img, path="fuzz")
    except CheckpointCorruptError as e:
        assert e.path == "fuzz"


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=5000)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data):
    _only_corrupt_errors(data)
    _only_corrupt_errors(MAGIC + struct.pack("<Q", len(data)) + data + bytes(-len(data) % 64))


@pytest.mark.timeout(120)
@settings(max_examples=500, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8
    ),
    st.integers(0, len(VALID)),
)
def test_fuzz_mutated_valid_file(edits, cut):
    img = bytearray(VALID)
    for pos, val in edits:
        img[pos] = val
    _only_corrupt_errors(bytes(img))
    _only_corrupt_errors(bytes(img[:cut]))


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=5000)
@given(st.binary(min_size=1, max_size=64), st.integers(16, 200))
def test_fuzz_inserted_header_bytes(junk, pos):
    """Random bytes spliced into the header, with the header length kept consistent."""
    (hlen,) = struct.unpack("<Q", VALID[8:16])
    pos = min(pos, 16 + hlen)
    header = VALID[16:pos] + junk + VALID[pos : 16 + hlen]
    data_start = -(-(16 + hlen) // 64) * 64
    _only_corrupt_errors(image(header, VALID[data_start:]))
