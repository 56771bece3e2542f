"""Where the bytes of a `torch.save`'d tensor lie inside its blob, read without `torch.load`.

DCP's default writer stores every tensor item as a `torch.save` zip archive (uncompressed
records; the storage's bytes in the record `<archive>/data/0`, 64-byte aligned). To read such
an item straight into the destination tensor, the reader needs two facts before the data: the
data record's offset and size (from the zip's central directory, at the end of the blob) and
what tensor the bytes make (dtype, shape, strides, storage offset: from the small pickle
`<archive>/data.pkl`, unpickled here with an allowlist that knows only the names a plain
tensor's pickle uses, so nothing in it can run). Anything else (another layout, a tensor
subclass, a compressed record) returns None, and the caller falls back to `torch.load`.
"""

from __future__ import annotations

import collections
import pickle
import struct
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch

TAIL = 8192  # bytes read from a blob's end: its central directory (about 1 KiB) and more

_EOCD = struct.Struct("<4s4H2LH")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_LOCATOR = struct.Struct("<4sLQL")
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_LOCAL = struct.Struct("<4s5H3L2H")


def _storage_dtypes() -> dict[str, torch.dtype]:
    """`FloatStorage` -> torch.float32, ...: the names a tensor's pickle gives its storage."""
    with warnings.catch_warnings():  # touching the legacy classes warns about TypedStorage
        warnings.simplefilter("ignore")
        classes = {n: getattr(torch, n) for n in dir(torch) if n.endswith("Storage")}
        return {
            n: c.dtype
            for n, c in classes.items()
            if isinstance(getattr(c, "dtype", None), torch.dtype)
        }


_STORAGE_DTYPES = _storage_dtypes()


class _Unsupported(Exception):
    """Not a plain tensor blob: the caller uses torch.load."""


@dataclass(frozen=True)
class Record:
    """One zip record: where its local header starts and how many bytes it holds."""

    header: int
    size: int


@dataclass(frozen=True)
class TensorBlob:
    """A plain tensor's bytes at [data_start, data_start + nbytes) of its blob."""

    data_start: int
    nbytes: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    def contiguous_whole(self) -> bool:
        """The tensor is exactly the storage's bytes, row-major: readable into a destination."""
        numel = 1
        for d in self.size:
            numel *= d
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return (
            self.storage_offset == 0
            and self.nbytes == numel * itemsize
            and self.stride == _row_major(self.size)
        )


def _row_major(size: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for d in reversed(size):
        out.append(step)
        step *= max(d, 1)
    return tuple(reversed(out))


def central_directory(tail: memoryview, blob_len: int) -> dict[str, Record] | None:
    """Records by name, from the last `len(tail)` bytes of a blob of `blob_len` bytes; None if
    the directory does not lie wholly inside `tail` or is not what torch.save writes."""
    try:
        return _directory(tail, blob_len)
    except (struct.error, _Unsupported, UnicodeDecodeError):
        return None


def _directory(tail: memoryview, blob_len: int) -> dict[str, Record]:
    base = blob_len - len(tail)  # blob offset of tail[0]
    end = len(tail) - _EOCD.size
    sig, _, _, _, count, _, cd_off, comment = _EOCD.unpack_from(tail, end)
    if sig != b"PK\x05\x06" or comment:
        raise _Unsupported
    if count == 0xFFFF or cd_off == 0xFFFFFFFF:
        loc = _LOCATOR.unpack_from(tail, end - _LOCATOR.size)
        if loc[0] != b"PK\x06\x07":
            raise _Unsupported
        rec = _EOCD64.unpack_from(tail, loc[2] - base)
        if rec[0] != b"PK\x06\x06":
            raise _Unsupported
        count, cd_off = rec[6], rec[8]
    pos = cd_off - base
    if pos < 0:
        raise _Unsupported  # the directory starts before the tail: the caller reads more
    out = {}
    for _ in range(count):
        f = _CENTRAL.unpack_from(tail, pos)
        if f[0] != b"PK\x01\x02" or f[4] != 0:  # only stored (uncompressed) records
            raise _Unsupported
        nlen, elen, clen, header = f[10], f[11], f[12], f[16]
        name = bytes(tail[pos + 46 : pos + 46 + nlen]).decode("utf-8")
        size, header = _zip64_fields(tail[pos + 46 + nlen : pos + 46 + nlen + elen], f[9], header)
        out[name] = Record(header, size)
        pos += 46 + nlen + elen + clen
    return out


def _zip64_fields(extra: memoryview, size: int, header: int) -> tuple[int, int]:
    """Sizes and offsets over 4 GiB live in the zip64 extra field (in the order the spec sets:
    uncompressed size, compressed size, header offset, each only when its 32-bit field is
    0xFFFFFFFF; stored records have both sizes equal)."""
    if size != 0xFFFFFFFF and header != 0xFFFFFFFF:
        return size, header
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<2H", extra, pos)
        if tag == 1:
            vals = list(struct.unpack_from(f"<{n // 8}Q", extra, pos + 4))
            if size == 0xFFFFFFFF:
                size = vals.pop(0)
                vals.pop(0)  # the compressed size: the same for a stored record
            if header == 0xFFFFFFFF:
                header = vals.pop(0)
            return size, header
        pos += 4 + n
    raise _Unsupported


def data_offset(head: memoryview, record: Record) -> int | None:
    """Where a record's bytes start, from its local header (which `head` must hold)."""
    try:
        sig, _, _, method, _, _, _, _, _, nlen, elen = _LOCAL.unpack_from(head, record.header)
    except struct.error:
        return None
    if sig != b"PK\x03\x04" or method != 0:
        return None
    return record.header + _LOCAL.size + nlen + elen


def parse(head: memoryview, records: dict[str, Record], data_end_limit: int) -> TensorBlob | None:
    """The tensor a blob holds, given its first bytes (`head`, through the data record's local
    header) and its directory; None if it is not one plain tensor with one storage."""
    pkl = next((n for n in records if n.endswith("/data.pkl")), None)
    order = next((n for n in records if n.endswith("/byteorder")), None)
    if pkl is None:
        return None
    start = data_offset(head, records[pkl])
    if start is None or start + records[pkl].size > len(head):
        return None
    try:
        if order is not None and _record_bytes(head, records[order]) != sys.byteorder.encode():
            return None
        desc = _Restricted(head[start : start + records[pkl].size]).load()
    except Exception:  # any other pickle: torch.load decides
        return None
    if not isinstance(desc, _Desc):
        return None
    prefix = pkl[: -len("data.pkl")]
    rec = records.get(f"{prefix}data/{desc.key}")
    if rec is None or len(records) > 8:
        return None
    data = data_offset(head, rec) if rec.header + _LOCAL.size <= len(head) else None
    if data is None or data + rec.size > data_end_limit:
        return None
    return TensorBlob(data, rec.size, desc.dtype, desc.size, desc.stride, desc.offset)


def _record_bytes(head: memoryview, record: Record) -> bytes | None:
    start = data_offset(head, record)
    if start is None or start + record.size > len(head):
        return None
    return bytes(head[start : start + record.size])


@dataclass(frozen=True)
class _Desc:
    key: str
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> _Desc:
    if not (isinstance(storage, tuple) and type(offset) is int):
        raise _Unsupported
    if not all(type(x) is int for x in (*size, *stride)) or len(size) != len(stride):
        raise _Unsupported
    return _Desc(storage[0], storage[1], offset, tuple(size), tuple(stride))


class _Restricted(pickle.Unpickler):
    """Only the names in a plain tensor's pickle; storages become (key, dtype) tuples."""

    def __init__(self, data: memoryview) -> None:
        import io

        super().__init__(io.BytesIO(data))

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise _Unsupported(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is tuple and len(pid) == 5 and pid[0] == "storage":
            _, dtype, key, _, _ = pid
            if isinstance(dtype, torch.dtype) and type(key) is str:
                return key, dtype
        raise _Unsupported("persistent id")
