"""What the golden checkpoints in tests/golden/v<N>/ hold, rebuilt from a seed.

scripts/make_golden.py saves these states and tests/test_golden.py rebuilds them to know, bit for
bit, what a load must return: the expectation is code, not a second copy of the data. Nothing
here may change once a golden folder was written from it: the pseudo-random bytes come from
SHA-256 in counter mode (not numpy/torch generators, whose streams may change between
releases), and the dtype lists are frozen per state version.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from typing import Any

import numpy as np
import torch

from forge_ckpt import Checkpointable

# Every tensor dtype forge_ckpt's serializer stores as of format version 2 (its
# `_TORCH_BLOB_DTYPES`), every numpy dtype kind it accepts, and both byte orders.
V2_TORCH_DTYPES = (
    "bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 bfloat16 float32 float64 "
    "complex32 complex64 complex128 float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz "
    "float8_e8m0fnu"
).split()
V2_NP_DTYPES = (
    "|b1 |i1 <i2 <i4 <i8 |u1 <u2 <u4 <u8 <f2 <f4 <f8 <c8 <c16 >i4 >u8 >f4 >f8 >c16".split()
)
BF16_PATTERNS = [0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001, 0x7FFF, 0xFFFF]


def stream(seed: int, label: str, n: int) -> bytes:
    """n pseudo-random bytes that every version of every library agrees on."""
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}/{label}/{counter}".encode()).digest()
        counter += 1
    return bytes(out[:n])


def tensor_bits(seed: int, label: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, subnormals) in any dtype; bools are 0 or 1."""
    n = math.prod(shape) * dtype.itemsize
    raw = torch.tensor(list(stream(seed, label, n)), dtype=torch.uint8)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def array_bits(seed: int, label: str, shape: tuple, dtype: str) -> np.ndarray:
    dt = np.dtype(dtype)
    raw = np.frombuffer(stream(seed, label, math.prod(shape) * dt.itemsize), np.uint8).copy()
    if dt.kind == "b":
        raw &= 1
    return raw.view(dt).reshape(shape)


def _tensors(seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in V2_TORCH_DTYPES:
        dtype = getattr(torch, name)
        out[name] = {
            "matrix": tensor_bits(seed, f"t/{name}", (3, 5), dtype),
            "scalar": tensor_bits(seed, f"t0/{name}", (), dtype),
            "empty": tensor_bits(seed, f"te/{name}", (0, 4), dtype),
            "empty3": tensor_bits(seed, f"te3/{name}", (2, 0, 3), dtype),
        }
    patterns = torch.tensor(BF16_PATTERNS, dtype=torch.int32).to(torch.int16)
    out["bf16_nan_payloads"] = patterns.view(torch.bfloat16)
    out["transposed"] = tensor_bits(seed, "tt", (4, 6), torch.bfloat16).t()  # not contiguous
    out["size"] = torch.Size([2, 0, 3 + seed % 5])
    out["dtype"] = torch.float8_e4m3fn
    return out


def _arrays(seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dt in V2_NP_DTYPES:
        out[dt] = {
            "matrix": array_bits(seed, f"a/{dt}", (4, 3), dt),
            "scalar": array_bits(seed, f"a0/{dt}", (), dt),
            "empty": array_bits(seed, f"ae/{dt}", (3, 0, 2), dt),
            "np_scalar": array_bits(seed, f"s/{dt}", (1,), dt)[0],
        }
    return out


def _python(seed: int) -> dict[str, Any]:
    (nan_payload,) = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_0000 + seed))
    return {
        "ints": [
            0,
            -1,
            seed,
            2**63 - 1,
            -(2**63),
            2**64 - 1,
            2**64,
            -(2**63) - 1,
            2**200 + seed,
            -(3**90) - seed,
        ],
        "floats": [0.0, -0.0, math.inf, -math.inf, nan_payload, 5e-324, 1.5 + seed],
        "strs": ["", "ascii", "ünïcödé ✓ 🎲", "lone \ud800 surrogate"],
        "bytes": [b"", stream(seed, "bytes", 37)],
        "tuples": (1, (2, (3, ())), "x", None, True, ()),
        "flags": [None, True, False],
        "empty": {"list": [], "dict": {}, "tuple": ()},
        "keys": {
            1: "int",
            -(2**63): "int64 min",
            2**70: "bigint",
            (1, "a", (2.5, None)): "tuple",
            2.5: "float",
            None: "none",
            "": "empty str",
            (): "empty tuple",
        },
        "nested": _nest(seed, 12),
        "order": {k: i for i, k in enumerate(["z", "a", "m", "b"])},  # key order is kept
    }


def _nest(seed: int, depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"leaf": seed}
    for level in range(depth):
        node = {level: node, (level, "t"): [level, (level,)]}
    return node


def actor_state(seed: int, version: int = 2) -> dict[str, Any]:
    """The state an actor of the golden checkpoint of `version` was saved with."""
    if version != 2:
        raise ValueError(f"no golden actor state for version {version}")
    return {"seed": seed, "tensors": _tensors(seed), "arrays": _arrays(seed), **_python(seed)}


class GoldenActor(Checkpointable):
    """An actor that writes its own file (with RNG streams); wrapped by `ray.remote`."""

    def __init__(self, seed: int, version: int = 2) -> None:
        self.state = actor_state(seed, version)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        self.gen = np.random.default_rng(seed)

    def rng_generators(self) -> dict[str, Any]:
        return {"gen": self.gen}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state

    def mismatch(self, seed: int, version: int = 2) -> str | None:
        """Compare here, not in the driver: torch cannot pickle uint16-64, complex32 or
        float8 tensors, so this state cannot cross a Ray call."""
        try:
            assert_bitwise(self.state, actor_state(seed, version))
        except AssertionError as e:
            return str(e)
        return None

    def probe(self) -> dict[str, Any]:
        """Draw from every stream the checkpoint restores."""
        return {
            "python": random.random(),
            "numpy": np.random.rand(3),
            "torch": torch.rand(4),
            "gen": self.gen.random(2),
        }


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def digest(value: Any) -> Any:
    """A JSON-able fingerprint that differs whenever any bit, dtype or shape differs."""
    if isinstance(value, torch.Tensor):
        sha = hashlib.sha256(_raw(value)).hexdigest()
        return {
            "tensor": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "sha256": sha,
        }
    if isinstance(value, np.ndarray):
        sha = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
        return {"ndarray": value.dtype.str, "shape": list(value.shape), "sha256": sha}
    if isinstance(value, float):
        return {"float": value.hex()}
    if isinstance(value, dict):
        return {str(k): digest(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [digest(v) for v in value]
    return value


def assert_bitwise(got: Any, want: Any, where: str = "state") -> None:
    """Equal types, dict key order, dtypes, shapes and every bit (NaN payloads, -0.0)."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert _raw(got) == _raw(want), f"{where}: bits differ"
    elif isinstance(want, (np.ndarray, np.generic)):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert got.tobytes() == want.tobytes(), f"{where}: bits differ"
    elif isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want), f"{where}: {got!r} != {want!r}"
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_bitwise(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_bitwise(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"
