"""Decoding a state file without unpickling anything: msgpack hooks rebuild tuples, big ints,
scalars and dtypes, and every tensor or array is a view of the buffer the file was read into,
after its descriptor was checked against the data section."""

from __future__ import annotations

import gc
import itertools
import math
from typing import Any

import msgpack
import numpy as np
import torch

from ..errors import CheckpointCorruptError
from ..storage import FileRecord, Storage, open_storage
from .format import (
    _KEY_PLAIN,
    _NP_DTYPE,
    _TORCH_BLOB_DTYPES,
    _TORCH_DTYPES,
    ALIGN,
    EXT_BIGINT,
    EXT_DTYPE,
    EXT_NDARRAY,
    EXT_NPSCALAR,
    EXT_SIZE,
    EXT_TENSOR,
    EXT_TUPLE,
    MAX_DEPTH,
    MAX_NDIM,
    PREAMBLE,
    check_preamble,
    split_path,
)


class _Corrupt(Exception):
    """A problem found while decoding; turned into CheckpointCorruptError with the path."""


_TUPLE = object()  # what the TUPLE ext decodes to until list_hook turns its array into a tuple


def _small(data: bytes) -> Any:
    """Decode an ext payload (flat msgpack, never itself holding exts we accept)."""
    n = len(data)
    return msgpack.unpackb(
        data, raw=False, max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n,
        max_ext_len=n,
    )  # fmt: skip


def _np_dtype(name: Any) -> np.dtype:
    if type(name) is not str or not _NP_DTYPE.match(name):
        raise _Corrupt(f"unknown numpy dtype {name!r}")
    return np.dtype(name)


def _valid_key(k: Any, depth: int = 0) -> bool:
    t = type(k)
    if t in _KEY_PLAIN:
        return True
    return t is tuple and depth < MAX_DEPTH and all(_valid_key(x, depth + 1) for x in k)


class _Decoder:
    """msgpack hooks that rebuild tuples, big ints, scalars and blob views; `data` None = describe."""

    def __init__(self, data: memoryview | None, start: int, size: int) -> None:
        self.data, self.start, self.size = data, start, size
        self.made = self.used = 0  # tuple markers decoded / consumed by list_hook

    def run(self, header: Any, path: str) -> Any:
        n = len(header)
        gc_was_on = gc.isenabled()  # the unpacker creates many objects and no cycles: a GC
        gc.disable()  # pass every 700 allocations would double the time of a list-heavy state
        try:
            tree = msgpack.unpackb(
                header, raw=False, use_list=True, strict_map_key=False,
                unicode_errors="surrogatepass", ext_hook=self.ext, list_hook=self.list_hook,
                object_hook=self.object_hook, max_str_len=n, max_bin_len=n, max_array_len=n,
                max_map_len=n, max_ext_len=n,
            )  # fmt: skip
        except _Corrupt as e:
            raise CheckpointCorruptError(path, f"bad header: {e}") from None
        except msgpack.StackError:
            raise CheckpointCorruptError(path, "bad header: nested too deeply") from None
        except Exception as e:
            raise CheckpointCorruptError(path, f"bad header: {type(e).__name__}: {e}") from e
        finally:
            if gc_was_on:
                gc.enable()
        if self.made != self.used:
            raise CheckpointCorruptError(path, "bad header: tuple marker outside an array head")
        return tree

    def list_hook(self, lst: list) -> list | tuple:
        if lst and lst[0] is _TUPLE:
            self.used += 1
            return tuple(itertools.islice(lst, 1, None))
        return lst

    def object_hook(self, d: dict) -> dict:
        for k in d:
            if type(k) is not str and not _valid_key(k):
                raise _Corrupt(f"map key of type {type(k).__name__}")
        return d

    def ext(self, code: int, data: bytes) -> Any:
        if code == EXT_TUPLE and not data:
            self.made += 1
            return _TUPLE
        if code == EXT_BIGINT and data:
            return int.from_bytes(data, "little", signed=True)
        if code in (EXT_TENSOR, EXT_NDARRAY):
            return self.blob(code, _small(data))
        if code == EXT_NPSCALAR:
            return _np_scalar(_small(data))
        if code == EXT_DTYPE and data.decode("ascii", "replace") in _TORCH_DTYPES:
            return _TORCH_DTYPES[data.decode("ascii")]
        if code == EXT_SIZE:
            dims = _small(data)
            if type(dims) is list and all(type(d) is int for d in dims):
                return torch.Size(dims)
        raise _Corrupt(f"unknown or malformed ext type {code} ({len(data)} bytes)")

    def blob(self, code: int, desc: Any) -> Any:
        """Check a blob descriptor against the data section and return a view (or a summary)."""
        if not (type(desc) is list and len(desc) == 4):
            raise _Corrupt(f"malformed blob descriptor {desc!r:.100}")
        dname, shape, off, nbytes = desc
        if not (
            type(shape) is list
            and len(shape) <= MAX_NDIM
            and all(type(d) is int and 0 <= d < 1 << 62 for d in shape)
            and type(off) is int
            and type(nbytes) is int
            and off >= 0
            and nbytes >= 0
        ):
            raise _Corrupt(f"malformed blob descriptor {desc!r:.100}")
        if code == EXT_TENSOR:
            dtype = _TORCH_BLOB_DTYPES.get(dname) if type(dname) is str else None
            if dtype is None:
                raise _Corrupt(f"unknown tensor dtype {dname!r:.40}")
        else:
            dtype = _np_dtype(dname)
        count = math.prod(shape)
        if count * dtype.itemsize != nbytes:
            raise _Corrupt(f"blob of {nbytes} bytes does not hold {dname}{shape}")
        if off % ALIGN or self.start + off + nbytes > self.size:
            raise _Corrupt(f"blob [{off}, {off + nbytes}) lies outside the data section")
        if self.data is None:
            kind = "tensor" if code == EXT_TENSOR else "ndarray"
            return f"{kind}({dname if code == EXT_TENSOR else dtype.name}, {shape})"
        return self.view(code, dtype, shape, count, self.start + off)

    def view(self, code: int, dtype: Any, shape: list, count: int, pos: int) -> Any:
        assert self.data is not None  # blob() returns a description when there is no data
        if code == EXT_TENSOR:
            if count == 0:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(self.data, dtype=dtype, count=count, offset=pos).view(shape)
        if count == 0:
            return np.zeros(shape, dtype)
        return np.frombuffer(self.data, dtype, count, pos).reshape(shape)


def _np_scalar(desc: Any) -> np.generic:
    if type(desc) is list and len(desc) == 2 and type(desc[1]) is bytes:
        dtype = _np_dtype(desc[0])
        if len(desc[1]) == dtype.itemsize:
            return np.frombuffer(desc[1], dtype)[0]
    raise _Corrupt(f"malformed numpy scalar {desc!r:.100}")


def loads(buf: bytes | bytearray | memoryview, *, path: str = "<memory>") -> Any:
    """Decode an in-memory file image; tensors/arrays are views of `buf` (copied if read-only)."""
    mv = memoryview(buf)
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    elif mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    hlen, start = check_preamble(bytes(mv[:PREAMBLE]), mv.nbytes, path)
    return _Decoder(mv, start, mv.nbytes).run(mv[PREAMBLE : PREAMBLE + hlen], path)


def load(path: str, expected: FileRecord | None = None) -> Any:
    """Read a local file or URL once (checking size/crc against `expected`) and decode it."""
    folder, name = split_path(path)
    return load_from(open_storage(folder), name, expected)


def load_from(store: Storage, relpath: str, expected: FileRecord | None = None) -> Any:
    """Read once (checked against `expected`) and decode without copies."""
    return loads(store.read_buffer(relpath, expected), path=store.where(relpath))


def describe(path: str) -> Any:
    """Decode only the header, with tensors/arrays shown as e.g. "tensor(bfloat16, [4, 8])"."""
    folder, name = split_path(path)
    return describe_from(open_storage(folder), name)


def describe_from(store: Storage, relpath: str) -> Any:
    where = store.where(relpath)
    size = store.size(relpath)
    if size is None:
        raise CheckpointCorruptError(where, "file is missing")
    head = bytes(store.read(relpath, 0, PREAMBLE))
    hlen, start = check_preamble(head, size, where)
    header = store.read(relpath, PREAMBLE, PREAMBLE + hlen)
    if len(header) != hlen:
        raise CheckpointCorruptError(where, "file ended inside the header")
    return _Decoder(None, start, size).run(bytes(header), where)
