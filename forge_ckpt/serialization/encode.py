"""Encoding a state: one walk that validates the tree, packs the msgpack header and collects
the tensors' and arrays' bytes (copied only when later mutation must not leak in), then a
write that streams header, padding and blobs to storage, checksummed as they go."""

from __future__ import annotations

import builtins
import dataclasses
import json
import struct
from typing import Any

import msgpack
import numpy as np
import torch

from ..actors.immutable import Immutable
from ..errors import NotSerializableError
from ..storage import FileRecord, Storage, open_storage
from ..storage.base import GatheredWrites
from .format import (
    _INT_MAX,
    _INT_MIN,
    _KEY_PLAIN,
    _PLAIN,
    _TORCH_BLOB_NAMES,
    _TUPLE_EXT,
    _U32,
    EXT_BIGINT,
    EXT_DTYPE,
    EXT_NDARRAY,
    EXT_NPSCALAR,
    EXT_SIZE,
    EXT_TENSOR,
    MAGIC,
    MAX_DEPTH,
    PREAMBLE,
    align,
    split_path,
)


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
        off = align(self.end)
        self.end = off + data.nbytes
        self.blobs.append((off, data))
        desc = msgpack.packb([dtype, [int(d) for d in shape], off, data.nbytes])
        self.packer.pack(msgpack.ExtType(code, desc))


class Snapshot:
    """An encoded state held in memory, independent of the source objects (when copy=True)."""

    def __init__(self, header: memoryview, blobs: list[tuple[int, memoryview]], end: int) -> None:
        self._header, self._blobs = header, blobs
        self._data_start = align(PREAMBLE + header.nbytes)
        self.nbytes = self._data_start + end

    def write(self, path: str, relpath: str) -> FileRecord:
        """Write to a local path or URL; the record carries `relpath`."""
        folder, name = split_path(path)
        rec = self.write_to(open_storage(folder), name, exclusive=False)
        return dataclasses.replace(rec, path=relpath)

    def write_to(self, store: Storage, relpath: str, exclusive: bool = True) -> FileRecord:
        """Write the file durably, checksummed as it goes; on error the partial file is removed.
        `exclusive` (a step's file): never over a file another writer made (Storage.writer)."""
        with store.writer(relpath, exclusive=exclusive) as w:
            w.size_hint(self.nbytes)
            out = GatheredWrites(w)
            out.write(MAGIC + struct.pack("<Q", self._header.nbytes))
            out.write(self._header)
            for off, data in self._blobs:
                out.write(bytes(self._data_start + off - out.pos))  # zeros up to the blob
                # the snapshot's own copies, or (copy=False) a source nothing changes until
                # the write ends: a streaming writer may send them without copying
                out.write(data, held=True)
            out.write(bytes(max(0, self._data_start - out.pos)))
            out.flush()
            rec = w.close()
        if rec.size != self.nbytes:
            raise AssertionError(
                f"{store.where(relpath)}: wrote {rec.size} bytes, expected {self.nbytes}"
            )
        return rec


def snapshot(state: Any, *, name: str, copy: bool = True) -> Snapshot:
    """Validate and encode `state`; with copy=True later mutation of the source cannot leak in."""
    enc = _Encoder(name, copy)
    enc.run(state)
    return Snapshot(enc.packer.getbuffer(), enc.blobs, enc.end)


def save(state: Any, path: str, relpath: str, *, name: str) -> FileRecord:
    """Encode without copying blobs and write; nothing is written if the state is invalid."""
    return snapshot(state, name=name, copy=False).write(path, relpath)
