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

from __future__ import annotations

import builtins
import dataclasses
import gc
import itertools
import json
import math
import re
import struct
from typing import Any

import msgpack
import numpy as np
import torch

from .actors.immutable import Immutable
from .errors import CheckpointCorruptError, NotSerializableError
from .storage import FileRecord, Storage, Writer, open_storage

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


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _where(name: str, path: tuple | None) -> str:
    """Render a path (a linked list of (parent, key-or-index)) as `name: state["a"][3]`."""
    parts = []
    while path is not None:
        path, comp = path
        parts.append(json.dumps(comp, ensure_ascii=False) if type(comp) is str else repr(comp))
    return f"{name}: state" + "".join(f"[{p}]" for p in reversed(parts))


def _plain_ints(seq: list | tuple) -> bool:
    """Every item an int that msgpack packs as itself (what `_Encoder.int` packs directly)."""
    return (
        len(seq) > 8
        and set(map(type, seq)) == {int}
        and _INT_MIN <= min(seq)
        and max(seq) <= _INT_MAX
    )


class _Encoder:
    """One iterative walk that validates the tree, packs the header and collects the blobs."""

    def __init__(self, name: str, copy: bool) -> None:
        self.name, self.copy = name, copy
        self.packer = msgpack.Packer(
            use_bin_type=True, autoreset=False, unicode_errors="surrogatepass"
        )
        self.blobs: list[tuple[int, memoryview]] = []
        self.end = 0  # bytes used in the data section
        self.frozen = False  # inside an `Immutable`: its blobs are referenced, never copied

    def err(self, path: tuple | None, problem: str) -> NotSerializableError:
        return NotSerializableError(_where(self.name, path), problem)

    def run(self, state: Any) -> None:
        stack: list = []  # frames: (iterator, path, depth, is_map, frozen)
        self.value(state, None, 0, stack, False)
        while stack:
            it, path, depth, is_map, frozen = stack[-1]
            for comp, val in it:
                if is_map:
                    self.key(comp, path, depth)
                if self.value(val, (path, comp), depth, stack, frozen):
                    break  # descend into the container just pushed; resume `it` later
            else:
                stack.pop()

    def value(self, obj: Any, path: tuple | None, depth: int, stack: list, frozen: bool) -> bool:
        """Pack `obj`; for a container, pack its header and push a frame (returns True)."""
        t = type(obj)
        if t is Immutable:
            return self.value(obj.value, path, depth, stack, True)
        if t in _PLAIN or t is bytearray:
            try:
                self.packer.pack(bytes(obj) if t is bytearray else obj)
            except ValueError as e:  # str/bytes longer than msgpack allows
                raise self.err(path, f"{t.__name__} is too large: {e}") from None
            return False
        if t is int:
            self.int(obj)
            return False
        if t is list or t is tuple or isinstance(obj, dict):
            if depth + 1 > MAX_DEPTH:
                raise self.err(path, f"nesting deeper than {MAX_DEPTH} levels is not supported")
            if len(obj) >= _U32:
                raise self.err(path, f"{t.__name__} of {len(obj)} items is too long")
            if t is list:
                self.packer.pack_array_header(len(obj))
            elif t is tuple:
                self.packer.pack_array_header(len(obj) + 1)
                self.packer.pack(_TUPLE_EXT)
            else:
                self.packer.pack_map_header(len(obj))
                stack.append((iter(obj.items()), path, depth + 1, True, frozen))
                return True
            if _plain_ints(obj):  # the same bytes, without a frame per item (an RNG state)
                pack = self.packer.pack
                for item in obj:
                    pack(item)
                return False
            stack.append((enumerate(obj), path, depth + 1, False, frozen))
            return True
        self.frozen = frozen
        self.leaf(obj, path)
        return False

    def int(self, obj: int) -> None:
        if _INT_MIN <= obj <= _INT_MAX:
            self.packer.pack(obj)
        else:
            raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
            self.packer.pack(msgpack.ExtType(EXT_BIGINT, raw))

    def key(self, k: Any, path: tuple | None, depth: builtins.int) -> None:
        t = type(k)
        if t is int:
            self.int(k)
        elif t in _KEY_PLAIN:
            self.packer.pack(k)
        elif t is tuple and depth < MAX_DEPTH:
            self.packer.pack_array_header(len(k) + 1)
            self.packer.pack(_TUPLE_EXT)
            for item in k:
                self.key(item, path, depth + 1)
        else:
            raise self.err(path, f"key of type {t.__name__} is not serializable")

    def leaf(self, obj: Any, path: tuple | None) -> None:
        if isinstance(obj, torch.Tensor):
            self.tensor(obj, path)
        elif type(obj) is torch.Size:
            self.packer.pack(msgpack.ExtType(EXT_SIZE, msgpack.packb(list(obj))))
        elif isinstance(obj, torch.dtype):
            name = str(obj).removeprefix("torch.")
            self.packer.pack(msgpack.ExtType(EXT_DTYPE, name.encode()))
        elif type(obj) is np.ndarray or isinstance(obj, np.memmap):
            if obj.dtype.kind not in "biufc" or obj.dtype.fields is not None:
                raise self.err(path, f"ndarray of dtype {obj.dtype} is not serializable")
            c = np.ascontiguousarray(obj)
            owned = not np.may_share_memory(c, obj)
            self.blob(EXT_NDARRAY, obj.dtype.str, obj.shape, c.reshape(-1).view(np.uint8), owned)
        elif isinstance(obj, np.generic) and obj.dtype.kind in "biufc":
            payload = msgpack.packb([obj.dtype.str, obj.tobytes()], use_bin_type=True)
            self.packer.pack(msgpack.ExtType(EXT_NPSCALAR, payload))
        elif isinstance(obj, np.generic):
            raise self.err(path, f"numpy scalar of dtype {obj.dtype} is not serializable")
        else:
            raise self.err(path, f"type {type(obj).__name__} is not serializable")

    def tensor(self, t: torch.Tensor, path: tuple | None) -> None:
        if t.layout != torch.strided:
            raise self.err(path, f"tensor with layout {t.layout} is not serializable (not strided)")
        name = _TORCH_BLOB_NAMES.get(t.dtype)
        if name is None:
            raise self.err(path, f"tensor of dtype {t.dtype} is not serializable")
        if t.device.type == "meta":
            raise self.err(path, "tensor on the meta device has no data to save")
        src = t.detach()
        c = src if src.device.type == "cpu" else src.cpu()
        c = c.resolve_conj().resolve_neg().contiguous()
        owned = src.device.type != "cpu" or (
            c.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
        )
        self.blob(EXT_TENSOR, name, tuple(t.shape), c.reshape(-1).view(torch.uint8).numpy(), owned)

    def blob(
        self, code: builtins.int, dtype: str, shape: tuple, raw: np.ndarray, owned: bool
    ) -> None:
        """Record a blob; copy its bytes only when the snapshot must not see later mutation."""
        # Any: numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12.
        arr: Any = raw if owned or not self.copy or self.frozen else raw.copy()
        data = memoryview(arr)
        off = _align(self.end)
        self.end = off + data.nbytes
        self.blobs.append((off, data))
        desc = msgpack.packb([dtype, [int(d) for d in shape], off, data.nbytes])
        self.packer.pack(msgpack.ExtType(code, desc))


class _Out:
    """Coalesces small writes (headers, padding, small blobs) into few large ones."""

    def __init__(self, w: Writer) -> None:
        self.w, self.buf, self.pos = w, bytearray(), 0

    def put(self, data: Any, held: bool = False) -> None:
        """`held`: `data` stays alive and unchanged until the writer closes (Writer.write_held)."""
        n = memoryview(data).nbytes
        if n >= 1 << 20:
            self.flush()
            if held:
                self.w.write_held(data)
            else:
                self.w.write(data)
        else:
            self.buf += data
            if len(self.buf) >= 4 << 20:
                self.flush()
        self.pos += n

    def pad_to(self, pos: int) -> None:
        self.put(bytes(pos - self.pos))

    def flush(self) -> None:
        if self.buf:
            self.w.write(self.buf)
            self.buf = bytearray()


class Snapshot:
    """An encoded state held in memory, independent of the source objects (when copy=True)."""

    def __init__(self, header: memoryview, blobs: list[tuple[int, memoryview]], end: int) -> None:
        self._header, self._blobs = header, blobs
        self._data_start = _align(PREAMBLE + header.nbytes)
        self.nbytes = self._data_start + end

    def write(self, path: str, relpath: str) -> FileRecord:
        """Write to a local path or URL; the record carries `relpath`."""
        folder, name = _split(path)
        rec = self.write_to(open_storage(folder), name, exclusive=False)
        return dataclasses.replace(rec, path=relpath)

    def write_to(self, store: Storage, relpath: str, exclusive: bool = True) -> FileRecord:
        """Write the file durably, checksummed as it goes; on error the partial file is removed.
        `exclusive` (a step's file): never over a file another writer made (Storage.writer)."""
        with store.writer(relpath, exclusive=exclusive) as w:
            w.size_hint(self.nbytes)
            out = _Out(w)
            out.put(MAGIC + struct.pack("<Q", self._header.nbytes))
            out.put(self._header)
            for off, data in self._blobs:
                out.pad_to(self._data_start + off)
                # the snapshot's own copies, or (copy=False) a source nothing changes until
                # the write ends: a streaming writer may send them without copying
                out.put(data, held=True)
            out.pad_to(max(out.pos, self._data_start))
            out.flush()
            rec = w.close()
        if rec.size != self.nbytes:
            raise AssertionError(
                f"{store.where(relpath)}: wrote {rec.size} bytes, expected {self.nbytes}"
            )
        return rec


def _split(path: str) -> tuple[str, str]:
    folder, _, name = path.rstrip("/").rpartition("/")
    return folder or ".", name


def snapshot(state: Any, *, name: str, copy: bool = True) -> Snapshot:
    """Validate and encode `state`; with copy=True later mutation of the source cannot leak in."""
    enc = _Encoder(name, copy)
    enc.run(state)
    return Snapshot(enc.packer.getbuffer(), enc.blobs, enc.end)


def save(state: Any, path: str, relpath: str, *, name: str) -> FileRecord:
    """Encode without copying blobs and write; nothing is written if the state is invalid."""
    return snapshot(state, name=name, copy=False).write(path, relpath)


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


def _preamble(head: bytes, size: int, path: str) -> tuple[int, int]:
    """Check magic and header length; returns (header length, start of the data section)."""
    if size < PREAMBLE or len(head) < PREAMBLE:
        raise CheckpointCorruptError(path, f"file is {size} bytes, too short for a state file")
    if head[:8] != MAGIC:
        raise CheckpointCorruptError(path, f"not a forge_ckpt state file (magic {head[:8]!r})")
    (hlen,) = struct.unpack_from("<Q", head, 8)
    start = _align(PREAMBLE + hlen)
    if hlen > size - PREAMBLE or start > size:
        raise CheckpointCorruptError(
            path, f"header of {hlen} bytes does not fit a {size}-byte file"
        )
    return hlen, start


def loads(buf: bytes | bytearray | memoryview, *, path: str = "<memory>") -> Any:
    """Decode an in-memory file image; tensors/arrays are views of `buf` (copied if read-only)."""
    mv = memoryview(buf)
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    elif mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    hlen, start = _preamble(bytes(mv[:PREAMBLE]), mv.nbytes, path)
    return _Decoder(mv, start, mv.nbytes).run(mv[PREAMBLE : PREAMBLE + hlen], path)


def load(path: str, expected: FileRecord | None = None) -> Any:
    """Read a local file or URL once (checking size/crc against `expected`) and decode it."""
    folder, name = _split(path)
    return load_from(open_storage(folder), name, expected)


def load_from(store: Storage, relpath: str, expected: FileRecord | None = None) -> Any:
    """Read once (checked against `expected`) and decode without copies."""
    return loads(store.read_buffer(relpath, expected), path=store.where(relpath))


def describe(path: str) -> Any:
    """Decode only the header, with tensors/arrays shown as e.g. "tensor(bfloat16, [4, 8])"."""
    folder, name = _split(path)
    return describe_from(open_storage(folder), name)


def describe_from(store: Storage, relpath: str) -> Any:
    where = store.where(relpath)
    size = store.size(relpath)
    if size is None:
        raise CheckpointCorruptError(where, "file is missing")
    head = bytes(store.read(relpath, 0, PREAMBLE))
    hlen, start = _preamble(head, size, where)
    header = store.read(relpath, PREAMBLE, PREAMBLE + hlen)
    if len(header) != hlen:
        raise CheckpointCorruptError(where, "file ended inside the header")
    return _Decoder(None, start, size).run(bytes(header), where)
