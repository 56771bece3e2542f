"""The state file's format (see the package docstring): its constants, the dtypes a blob may
have, and the checks of a file's first bytes, shared by the encoder and the decoder."""

from __future__ import annotations

import re
import struct

import msgpack
import torch

from ..errors import CheckpointCorruptError

MAGIC = b"FCKPT\x00\x01\n"
PREAMBLE = 16  # magic + u64 header length
ALIGN = 64
MAX_DEPTH = 256  # containers nested deeper than this are refused on save
MAX_NDIM = 64
EXT_TUPLE, EXT_BIGINT, EXT_NDARRAY, EXT_TENSOR, EXT_NPSCALAR, EXT_DTYPE, EXT_SIZE = range(1, 8)

_U32 = 0xFFFFFFFF  # msgpack's limit on lengths
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1
_PLAIN = {type(None), bool, float, str, bytes}
_KEY_PLAIN = {type(None), bool, float, str, int}
_TUPLE_EXT = msgpack.ExtType(EXT_TUPLE, b"")
_TORCH_BLOB_DTYPES = {
    n: getattr(torch, n)
    for n in (
        "bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 bfloat16 float32 float64 "
        "complex32 complex64 complex128 float8_e4m3fn float8_e4m3fnuz float8_e5m2 "
        "float8_e5m2fnuz float8_e8m0fnu"
    ).split()
    if isinstance(getattr(torch, n, None), torch.dtype)
}
_TORCH_BLOB_NAMES = {v: k for k, v in _TORCH_BLOB_DTYPES.items()}
_TORCH_DTYPES = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
_NP_DTYPE = re.compile(r"[<>|=][biufc][0-9]{1,2}\Z")


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def split_path(path: str) -> tuple[str, str]:
    folder, _, name = path.rstrip("/").rpartition("/")
    return folder or ".", name


def check_preamble(head: bytes, size: int, path: str) -> tuple[int, int]:
    """Check magic and header length; returns (header length, start of the data section)."""
    if size < PREAMBLE or len(head) < PREAMBLE:
        raise CheckpointCorruptError(path, f"file is {size} bytes, too short for a state file")
    if head[:8] != MAGIC:
        raise CheckpointCorruptError(path, f"not a forge_ckpt state file (magic {head[:8]!r})")
    (hlen,) = struct.unpack_from("<Q", head, 8)
    start = align(PREAMBLE + hlen)
    if hlen > size - PREAMBLE or start > size:
        raise CheckpointCorruptError(
            path, f"header of {hlen} bytes does not fit a {size}-byte file"
        )
    return hlen, start
