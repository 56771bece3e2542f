"""Helpers shared by the serialization tests: dtype lists and exact comparisons."""

from __future__ import annotations

import math
import os
import struct

import numpy as np
import torch

from forge_ckpt.serialization import load, save

TORCH_DTYPES = [
    getattr(torch, n)
    for n in (
        "bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 bfloat16 float32 "
        "float64 complex64 complex128 float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz "
        "float8_e8m0fnu"
    ).split()
    if hasattr(torch, n)
]
NP_DTYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.longdouble, np.complex64, np.complex128,
    np.dtype(">f4"), np.dtype(">i8"),
]  # fmt: skip


# ---------------------------------------------------------------- helpers


def roundtrip(state, tmp_path, name="c"):
    path = str(tmp_path / "state.bin")
    rec = save(state, path, "state.bin", name=name)
    assert rec.size == os.path.getsize(path)
    return load(path, rec)


def bits(x) -> bytes:
    """Raw bytes of a tensor/array, whatever its dtype (bfloat16, float8, bool, complex)."""
    if isinstance(x, torch.Tensor):
        return x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def same(a, b) -> bool:
    """Deep equality that is exact: types, dict order, floats and blobs compared by their bits."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            same(ka, kb) and same(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    return a == b


def random_bits(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, subnormals, odd bools) in any dtype."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)
