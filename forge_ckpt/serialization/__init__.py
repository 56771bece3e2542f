"""One file per actor state: msgpack for the structure, raw aligned blobs for tensors and arrays.

Nothing is ever unpickled, so a checkpoint file cannot run code when loaded, and a hostile or
corrupt file fails with `CheckpointCorruptError` instead of crashing or exhausting memory.

File format, version 1 (integers little-endian)::

    offset 0    8 bytes   magic b"FCKPT\\x00\\x01\\n" (the 7th byte is the format version)
    offset 8    u64       H, the length of the header in bytes
    offset 16   H bytes   header: one msgpack object, the state tree (below)
                zeros     padding up to D, the first multiple of 64 that is >= 16 + H
    offset D    blobs     the data section: each tensor's / array's bytes in C order, at
                          D + its offset; every offset is a multiple of 64, zeros in between
    the file ends with the last blob (its size is D when there are none)

The header uses plain msgpack for None, bool, int in [-2**63, 2**64), float (always float64,
bit-exact incl. NaN payloads and -0.0), str (UTF-8, lone surrogates via "surrogatepass"), bytes
(bin; bytearray is stored as bytes), list (array) and dict (map; keys str, int, float, bool,
None or tuples of those; key order is kept). Everything else is an ext type:

    1 TUPLE     empty payload; an array whose first item is this ext is a tuple of the rest
    2 BIGINT    signed two's complement, little-endian, minimal length (ints beyond int64/uint64)
    3 NDARRAY   msgpack [dtype.str e.g. "<f4" / "|b1", shape, offset, nbytes]
    4 TENSOR    msgpack [torch dtype name e.g. "bfloat16", shape, offset, nbytes]
    5 NPSCALAR  msgpack [dtype.str, raw bytes]: np.float32(1.5), np.int64(3), np.bool_(True), ...
    6 DTYPE     UTF-8 torch dtype name, e.g. "float32"
    7 SIZE      msgpack array of ints (torch.Size)

For NDARRAY and TENSOR, offset is relative to D and nbytes = prod(shape) * itemsize. Arrays keep
their dtype's byte order; tensors are stored in the machine's (little-endian) order. Numpy dtypes
are limited to bool, int, uint, float and complex; tensors must be strided (CUDA tensors are
copied to CPU on save and load on CPU). Saving refuses containers nested deeper than MAX_DEPTH
(256). Loading checks every length against the header size, every blob against the data section
(64-aligned offset, nbytes matching shape and dtype, at most 64 dims) and accepts only the ext
codes above (msgpack itself decodes code -1, timestamps).
"""

from .decode import describe, describe_from, load, load_from, loads
from .encode import Snapshot, save, snapshot
from .format import (
    ALIGN,
    EXT_BIGINT,
    EXT_DTYPE,
    EXT_NDARRAY,
    EXT_NPSCALAR,
    EXT_SIZE,
    EXT_TENSOR,
    EXT_TUPLE,
    MAGIC,
    MAX_DEPTH,
    MAX_NDIM,
    PREAMBLE,
)

__all__ = [
    "ALIGN",
    "EXT_BIGINT",
    "EXT_DTYPE",
    "EXT_NDARRAY",
    "EXT_NPSCALAR",
    "EXT_SIZE",
    "EXT_TENSOR",
    "EXT_TUPLE",
    "MAGIC",
    "MAX_DEPTH",
    "MAX_NDIM",
    "PREAMBLE",
    "Snapshot",
    "describe",
    "describe_from",
    "load",
    "load_from",
    "loads",
    "save",
    "snapshot",
]
