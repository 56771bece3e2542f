"""Round trips, error reporting and memory behaviour of `forge_ckpt.serialization`."""

from __future__ import annotations

import collections
import math
import os
import random
import struct
import sys
import tracemalloc
import warnings

import numpy as np
import pytest
import torch

from forge_ckpt import serialization
from forge_ckpt.actors import rng
from forge_ckpt.errors import CheckpointCorruptError, NotSerializableError
from forge_ckpt.serialization import MAGIC, describe, load, loads, save, snapshot
from forge_ckpt.storage import FileRecord

sys.path.insert(0, os.path.dirname(__file__))
from serialization_util import NP_DTYPES, TORCH_DTYPES, bits, random_bits, roundtrip, same  # noqa: E402

# ---------------------------------------------------------------- tensors and arrays


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 5), (), (0, 4), (2, 0, 3)], ids=str)
def test_tensor_roundtrip_every_dtype(tmp_path, dtype, shape):
    t = random_bits(shape, dtype)
    out = roundtrip({"t": t}, tmp_path)["t"]
    assert type(out) is torch.Tensor and out.device.type == "cpu"
    assert out.dtype == dtype and out.shape == t.shape and out.is_contiguous()
    assert bits(out) == bits(t)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_tensor_noncontiguous(tmp_path, dtype):
    base = random_bits((6, 8), dtype, seed=1)
    views = {"t": base.t(), "step": base[::2, 1::3], "expand": base[:1].expand(4, 8)}
    out = roundtrip(views, tmp_path)
    for k, v in views.items():
        assert out[k].is_contiguous() and out[k].shape == v.shape and out[k].dtype == dtype
        assert bits(out[k]) == bits(v), k


def test_bfloat16_nan_payloads_bitwise(tmp_path):
    patterns = [0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001, 0x7FFF, 0xFFFF]
    t = torch.tensor(patterns, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    out = roundtrip([t], tmp_path)[0]
    assert out.dtype == torch.bfloat16
    assert out.view(torch.int16).tolist() == t.view(torch.int16).tolist()


def test_tensor_variants(tmp_path):
    p = torch.nn.Parameter(torch.randn(3, 2))
    c = torch.randn(4, dtype=torch.complex64)
    state = {
        "param": p,
        "grad": torch.randn(3, requires_grad=True) * 2,
        "conj": c.conj(),
        "neg": torch.randn(3, dtype=torch.complex64).conj().imag,
        "offset": torch.arange(10.0)[3:7],
    }
    out = roundtrip(state, tmp_path)
    assert type(out["param"]) is torch.Tensor and torch.equal(out["param"], p.detach())
    assert torch.equal(out["grad"], state["grad"].detach()) and not out["grad"].requires_grad
    assert torch.equal(out["conj"], c.conj().resolve_conj())
    assert torch.equal(out["neg"], state["neg"].resolve_neg())
    assert out["offset"].tolist() == [3.0, 4.0, 5.0, 6.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensor_loads_on_cpu(tmp_path):
    t = torch.randn(5, 7, device="cuda").to(torch.bfloat16)
    out = roundtrip({"t": t}, tmp_path)["t"]
    assert out.device.type == "cpu" and bits(out) == bits(t.cpu())


@pytest.mark.parametrize("dtype", NP_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4, 3), (), (0,), (3, 0, 2)], ids=str)
def test_array_roundtrip_every_dtype(tmp_path, dtype, shape):
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    raw = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    if dtype.kind == "b":
        raw &= 1
    a = raw.view(dtype).reshape(shape)
    out = roundtrip({"a": a}, tmp_path)["a"]
    assert type(out) is np.ndarray and out.dtype == dtype and out.shape == a.shape
    assert out.flags.c_contiguous and out.flags.writeable
    assert bits(out) == bits(a)


@pytest.mark.parametrize("dtype", [np.float32, np.complex128, np.bool_, np.float16], ids=str)
def test_array_fortran_and_strided(tmp_path, dtype):
    base = (np.arange(48) % 7).astype(dtype).reshape(6, 8)
    state = {"f": np.asfortranarray(base), "step": base[::2, ::-3], "t": base.T}
    out = roundtrip(state, tmp_path)
    for k, v in state.items():
        assert out[k].flags.c_contiguous and out[k].dtype == v.dtype
        assert np.array_equal(out[k], v), k


def test_memmap_roundtrip(tmp_path):
    mm = np.memmap(tmp_path / "mm", dtype=np.float32, mode="w+", shape=(5,))
    mm[:] = [1, 2, 3, 4, 5]
    out = roundtrip({"m": mm}, tmp_path)["m"]
    assert type(out) is np.ndarray and out.tolist() == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------- plain values and containers


FLOATS = [0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308]
NAN_PAYLOAD = struct.unpack("<d", bytes.fromhex("0100000000f8ff7f"))[0]


def test_plain_values(tmp_path):
    ints = [0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**63) - 1, 2**128 + 7, -(2**1000)]
    state = {
        "none": None,
        "bools": [True, False],
        "ints": ints,
        "floats": [*FLOATS, NAN_PAYLOAD, -NAN_PAYLOAD],
        "strs": ["", "héllo", "日本", "\ud800 lone surrogate", "x" * 100_000],
        "bytes": [b"", b"\x00\xff" * 10, bytearray(b"abc")],
    }
    out = roundtrip(state, tmp_path)
    state["bytes"][2] = b"abc"  # bytearray comes back as bytes
    assert same(out, state)
    assert [type(i) for i in out["ints"]] == [int] * len(ints)


def test_tuples_stay_tuples(tmp_path):
    state = {
        "t": (1, (2, (3, ())), [4, (5,)]),
        "empty": (),
        "in_list": [(), (None,), ([],)],
        "keys": {(1, "a"): 1, (2, (3, None)): 2, (): 3},
    }
    out = roundtrip(state, tmp_path)
    assert same(out, state)
    assert type(out["t"][1][1][1]) is tuple and type(out["t"][2]) is list
    assert type(out["in_list"][2][0]) is list


def test_dict_keys_and_order(tmp_path):
    state = {
        "optimizer": {
            "state": {0: {"step": 3}, 1: {"step": 4}},
            "param_groups": [{"params": [0, 1]}],
        },
        "mixed": {"b": 1, 2: 2, 1.5: 3, True: 4, None: 5, -(2**70): 6, ("t", 1): 7, "a": 8},
        "ordered": collections.OrderedDict([("z", 1), ("a", 2)]),
    }
    out = roundtrip(state, tmp_path)
    assert same(out["optimizer"], state["optimizer"])
    assert list(out["mixed"].items()) == list(state["mixed"].items())
    assert type(out["ordered"]) is dict and list(out["ordered"]) == ["z", "a"]


def test_numpy_scalars_keep_their_type(tmp_path):
    scalars = [
        np.float32(1.5), np.float64(-0.0), np.float16(np.nan), np.longdouble(1) / 3,
        np.int8(-3), np.int64(2**62), np.uint64(2**64 - 1), np.uint8(7), np.bool_(True),
        np.bool_(False), np.complex64(1 + 2j), np.complex128(-1j),
    ]  # fmt: skip
    out = roundtrip(scalars, tmp_path)
    assert [type(s) for s in out] == [type(s) for s in scalars]
    assert all(same(a, b) for a, b in zip(out, scalars, strict=True))


def test_torch_size_and_dtype(tmp_path):
    state = {"size": torch.Size([2, 3]), "empty": torch.Size([]), "dtypes": list(TORCH_DTYPES)}
    state["dtypes"] += [torch.quint8, torch.float]
    out = roundtrip(state, tmp_path)
    assert type(out["size"]) is torch.Size and out["size"] == (2, 3)
    assert type(out["empty"]) is torch.Size and out["empty"] == ()
    assert out["dtypes"] == state["dtypes"]


def test_nested_containers(tmp_path):
    leaf = {"a": [1, 2.0, "x"], "b": (np.arange(3), torch.ones(2))}
    state = {"deep": [[[[[leaf]]]]], "many": [dict(leaf, i=i) for i in range(200)]}
    assert same(roundtrip(state, tmp_path), state)


def test_max_depth_is_accepted(tmp_path):
    state = x = []
    for _ in range(serialization.MAX_DEPTH - 1):
        x.append([])
        x = x[0]
    out = roundtrip(state, tmp_path)
    depth = 0
    while out:
        out, depth = out[0], depth + 1
    assert depth == serialization.MAX_DEPTH - 1


# ---------------------------------------------------------------- random number generators


def test_rng_states_restore_the_same_draws(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    gen = np.random.default_rng(4)
    tgen = torch.Generator().manual_seed(5)
    pyr = random.Random(6)
    for _ in range(3):  # move away from the seeded state, incl. a cached gauss
        random.gauss(0, 1), np.random.normal(), gen.random(), torch.rand(1, generator=tgen)
    state = {
        "python": random.getstate(),
        "random_obj": pyr.getstate(),
        "numpy": np.random.get_state(),
        "gen": gen.bit_generator.state,
        "torch": torch.random.get_rng_state(),
        "tgen": tgen.get_state(),
    }
    assert (
        isinstance(state["gen"]["state"]["state"], int) and state["gen"]["state"]["state"] > 2**64
    )

    def draws():
        return (
            [random.random() for _ in range(3)] + [random.gauss(0, 1), pyr.random()],
            np.random.random(3).tolist() + [np.random.normal()],
            gen.random(3).tolist(),
            torch.rand(3).tolist() + torch.rand(3, generator=tgen).tolist(),
        )

    expected = draws()
    out = roundtrip(state, tmp_path)
    assert type(out["python"]) is tuple and type(out["python"][1]) is tuple
    random.setstate(out["python"])
    pyr.setstate(out["random_obj"])
    np.random.set_state(out["numpy"])
    gen.bit_generator.state = out["gen"]
    torch.random.set_rng_state(out["torch"])
    tgen.set_state(out["tgen"])
    assert draws() == expected


def test_rng_module_capture_roundtrip(tmp_path):
    gens = {"np": np.random.default_rng(7), "py": random.Random(8)}
    state = rng.capture(gens)
    expected = (random.random(), np.random.random(), gens["np"].random(), gens["py"].random())
    out = roundtrip(state, tmp_path)
    rng.restore(out, gens)
    assert (random.random(), np.random.random(), gens["np"].random(), gens["py"].random()) == (
        expected
    )


# ---------------------------------------------------------------- errors at save time


class Foo:
    pass


def test_error_names_the_path_exactly(tmp_path):
    items = [{"obs": 1}, {"obs": 2}, {"obs": 3}, {"obs": Foo()}]
    path = tmp_path / "x.bin"
    with pytest.raises(NotSerializableError) as info:
        save({"items": items}, str(path), "x.bin", name="replay_buffer")
    err = info.value
    assert str(err) == 'replay_buffer: state["items"][3]["obs"]: type Foo is not serializable'
    assert err.where == 'replay_buffer: state["items"][3]["obs"]'
    assert err.problem == "type Foo is not serializable"
    assert isinstance(err, TypeError)
    assert not path.exists()


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized dtypes are deprecated; still reject them
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)


def _nested(depth):
    state = x = []
    for _ in range(depth - 1):
        x.append([])
        x = x[0]
    return state


@pytest.mark.parametrize(
    "state, where, problem",
    [
        (Foo(), "state", "type Foo is not serializable"),
        ({"a": {Foo(): 1}}, 'state["a"]', "key of type Foo is not serializable"),
        ({"a": {b"k": 1}}, 'state["a"]', "key of type bytes is not serializable"),
        ({"a": {np.int64(1): 1}}, 'state["a"]', "key of type int64 is not serializable"),
        ({"a": {(1, Foo()): 1}}, 'state["a"]', "key of type Foo is not serializable"),
        ({1: [0, {"s": {1, 2}}]}, 'state[1][1]["s"]', "type set is not serializable"),
        (
            [np.array([1, "a"], dtype=object)],
            "state[0]",
            "ndarray of dtype object is not serializable",
        ),
        ([np.array(["ab"])], "state[0]", "ndarray of dtype <U2 is not serializable"),
        ([np.str_("a")], "state[0]", "numpy scalar of dtype <U1 is not serializable"),
        ({"c": lambda: 0}, 'state["c"]', "type function is not serializable"),
        ({"t": (1, 2, object())}, 'state["t"][2]', "type object is not serializable"),
        ({"m": np.ma.masked_array([1, 2])}, 'state["m"]', "type MaskedArray is not serializable"),
        (
            {"q": _quantized()},
            'state["q"]',
            "tensor of dtype torch.quint8 is not serializable",
        ),
        (
            {"s": torch.eye(3).to_sparse()},
            'state["s"]',
            "tensor with layout torch.sparse_coo is not serializable (not strided)",
        ),
        (
            {"m": torch.empty(2, device="meta")},
            'state["m"]',
            "tensor on the meta device has no data to save",
        ),
        (
            {"deep": _nested(serialization.MAX_DEPTH)},
            'state["deep"]' + "[0]" * (serialization.MAX_DEPTH - 1),
            f"nesting deeper than {serialization.MAX_DEPTH} levels is not supported",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None,
)
def test_unsupported_values_fail_before_writing(tmp_path, state, where, problem):
    path = tmp_path / "x.bin"
    with pytest.raises(NotSerializableError) as info:
        save(state, str(path), "x.bin", name="comp")
    assert info.value.where == f"comp: {where}"
    assert info.value.problem == problem
    assert not path.exists()
    with pytest.raises(NotSerializableError):
        snapshot(state, name="comp")


def test_failed_write_removes_partial_file(tmp_path, monkeypatch):
    snap = snapshot({"a": np.zeros(1000)}, name="c")
    monkeypatch.setenv("FORGE_CKPT_FAULT", "fsync:EIO")
    path = tmp_path / "x.bin"
    with pytest.raises(OSError):
        snap.write(str(path), "x.bin")
    assert not path.exists()


# ---------------------------------------------------------------- copies and views


def test_snapshot_copy_is_a_consistent_cut(tmp_path):
    t, a, lst = torch.zeros(4), np.zeros(4), [1, 2]
    snap = snapshot({"t": t, "a": a, "l": lst}, name="c", copy=True)
    t += 1
    a += 1
    lst.append(3)
    snap.write(str(tmp_path / "x"), "x")
    out = load(str(tmp_path / "x"))
    assert out["t"].tolist() == [0.0] * 4 and out["a"].tolist() == [0.0] * 4 and out["l"] == [1, 2]


def test_snapshot_without_copy_keeps_views(tmp_path):
    """copy=False writes straight from the source memory: a later change shows up."""
    t, a = torch.zeros(4), np.zeros(4)
    snap = snapshot({"t": t, "a": a}, name="c", copy=False)
    t += 1
    a += 1
    snap.write(str(tmp_path / "x"), "x")
    out = load(str(tmp_path / "x"))
    assert out["t"].tolist() == [1.0] * 4 and out["a"].tolist() == [1.0] * 4


def _root(a):
    while isinstance(a, np.ndarray) or isinstance(a, memoryview):
        a = a.base if isinstance(a, np.ndarray) else a.obj
    return a


def test_loaded_blobs_are_views_of_one_buffer(tmp_path):
    state = {"a": np.arange(16, dtype=np.float32), "t": torch.arange(4.0), "b": np.ones(3)}
    out = roundtrip(state, tmp_path)
    a, t, b = out["a"], out["t"], out["b"]
    assert isinstance(_root(a), bytearray) and _root(a) is _root(b)
    # layout: a at data offset 0 (64 bytes), t at 64, b at 128: addresses follow the file
    assert t.data_ptr() - a.ctypes.data == 64
    assert b.ctypes.data - a.ctypes.data == 128
    a[0] = 42  # writable, and changing it does not disturb its neighbours
    assert b.tolist() == [1.0, 1.0, 1.0] and t.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_file_layout(tmp_path):
    a = np.arange(5, dtype="<i4")
    t = torch.arange(3, dtype=torch.int16)
    path = str(tmp_path / "x")
    snap = snapshot({"a": a, "t": t}, name="c")
    rec = snap.write(path, "x")
    raw = open(path, "rb").read()
    assert raw[:8] == MAGIC and len(MAGIC) == 8
    (hlen,) = struct.unpack("<Q", raw[8:16])
    start = -(-(16 + hlen) // 64) * 64
    assert raw[16 + hlen : start] == bytes(start - 16 - hlen)
    assert raw[start : start + 20] == a.tobytes()
    assert raw[start + 20 : start + 64] == bytes(44)
    assert raw[start + 64 :] == t.numpy().tobytes()
    assert rec == FileRecord("x", len(raw), rec.crc32c) and snap.nbytes == len(raw)


def test_loads_from_readonly_bytes_gives_writable_arrays(tmp_path):
    path = str(tmp_path / "x")
    save({"a": np.arange(3.0), "t": torch.ones(2)}, path, "x", name="c")
    out = loads(open(path, "rb").read())
    out["a"][0] = 5.0
    out["t"][0] = 5.0
    assert out["a"].tolist() == [5.0, 1.0, 2.0]


@pytest.mark.timeout(120)
def test_512mib_array_roundtrip_without_extra_copies(tmp_path):
    a = np.arange(1 << 26, dtype=np.int64)  # 512 MiB
    path = str(tmp_path / "big")
    rec = save({"a": a, "small": [1, 2]}, path, "big", name="c")
    assert rec.size < a.nbytes + 4096
    tracemalloc.start()
    try:
        out = load(path, rec)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    os.unlink(path)
    assert peak < a.nbytes * 1.05, f"loading used {peak / 2**20:.0f} MiB for a 512 MiB file"
    ok = np.array_equal(out["a"], a)
    del a, out
    assert ok


# ---------------------------------------------------------------- verification and describe


def test_corruption_detected_against_the_record(tmp_path):
    path = str(tmp_path / "x.bin")
    rec = save({"a": np.arange(100.0)}, path, "x.bin", name="c")
    raw = bytearray(open(path, "rb").read())
    raw[-5] ^= 0x10
    open(path, "wb").write(raw)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch") as info:
        load(path, rec)
    assert info.value.path == path and path in str(info.value)
    open(path, "wb").write(raw[:-1])
    with pytest.raises(CheckpointCorruptError, match="size is") as info:
        load(path, rec)
    assert info.value.path == path
    os.unlink(path)
    with pytest.raises(CheckpointCorruptError, match="missing"):
        load(path, rec)


def test_describe(tmp_path):
    path = str(tmp_path / "x.bin")
    state = {
        "w": torch.zeros(4, 8, dtype=torch.bfloat16),
        "a": np.zeros(3, np.float32),
        "s": np.float32(2.0),
        "meta": {"step": 7, "t": (1, "x")},
        "e": torch.zeros(0),
        "z": np.array(1, dtype=">i2"),
    }
    save(state, path, "x.bin", name="c")
    assert describe(path) == {
        "w": "tensor(bfloat16, [4, 8])",
        "a": "ndarray(float32, [3])",
        "s": np.float32(2.0),
        "meta": {"step": 7, "t": (1, "x")},
        "e": "tensor(float32, [0])",
        "z": "ndarray(int16, [])",
    }
