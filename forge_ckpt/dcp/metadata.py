"""Read DCP's `.metadata` without running code from it.

`torch.distributed.checkpoint` pickles its `Metadata` into `.metadata`, and
`FileSystemReader.read_metadata` calls `pickle.load` on it: whoever can write the checkpoint
folder could run code on every machine that loads it. `load_metadata` unpickles the same bytes
with an allowlist instead, so forge_ckpt never calls an unrestricted unpickler on checkpoint data.

Why the allowlist is safe. Pickle can only call what `find_class` hands it (REDUCE, NEWOBJ,
INST, OBJ, and a BUILD that finds a `__setstate__`), so the allowlist bounds everything a file
can run. It holds:

* the plain dataclasses of DCP's format (`Metadata`, `TensorStorageMetadata`,
  `BytesStorageMetadata`, `ChunkStorageMetadata`, `StorageMeta`, `MetadataIndex`,
  `TensorProperties` and `filesystem._StorageInfo`). They are rebuilt with NEWOBJ
  (`object.__new__`) + BUILD, which only fills the instance `__dict__`; none defines
  `__setattr__` (apart from the raising one of the frozen `MetadataIndex`), properties or slots.
  `TensorProperties.__setstate__` only unpacks a 5-tuple and compares one field with its enum
  members. A `__setstate__` planted in an instance `__dict__` could only be another allowed
  callable, which the file could call with REDUCE anyway;
* torch dtypes, which pickle as the global `torch.<name>`: objects, not callables;
* the few callables DCP pickles, each replaced by a wrapper that checks its arguments before
  doing a lookup or building a value: `torch.Size` (a tuple of ints), `torch.serialization.
  _get_layout` (a name looked up among torch's layouts), `_MEM_FORMAT_ENCODING` (an int looked
  up among its members) and `pathlib.PosixPath` (strings; `FileSystemWriter` stores the save
  folder as a `Path` in `storage_meta.checkpoint_id`; Python 3.13 spells it
  `pathlib._local.PosixPath`). No wrapper can reach the file system or import anything.

Everything else (`os.system`, `builtins.eval`, `copyreg._reconstructor`, `__builtin__` aliases,
`torch._utils._rebuild_tensor_v2`, ...) is refused before it is looked up, persistent ids are
refused, and the result must be a `Metadata`. The set was found by recording every global that
the `.metadata` files of real `dcp.save` calls refer to (torch 2.13, Python 3.11, pickle
protocol 4): a model with AdamW, tensors of every dtype DCP can save, non-tensor values, a
TorchTitan-style flattened state with `OptimizersContainer`/`LRSchedulersContainer`, the
safetensors serialization format, and a 2-rank FSDP2 save on gloo (DTensor shards need nothing
more). torch 2.11 (on GPU machines) defines the same classes and should pickle the same set;
that was not checked on a real 2.11 file. A global a future torch adds is refused loudly,
never loaded silently.

Not covered: resource exhaustion. A crafted memo index (LONG_BINPUT) makes the C unpickler
allocate gigabytes before failing; verify `.metadata` against the manifest checksums first.
"""

from __future__ import annotations

import functools
import io
import pathlib
import pickle
from collections.abc import Collection
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint import metadata as _dcp_md

from forge_ckpt.errors import CheckpointCorruptError

__all__ = ["load_metadata"]

_MD = "torch.distributed.checkpoint.metadata"


def _size(dims: Any = ()) -> torch.Size:
    """`torch.Size` from a tuple of plain ints (what `Size.__reduce__` writes)."""
    if not isinstance(dims, tuple) or not all(type(d) is int for d in dims):
        raise ValueError(f"torch.Size expects a tuple of ints, not {type(dims).__name__}")
    return torch.Size(dims)


@functools.cache
def _layouts() -> dict[str, torch.layout]:
    return {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: Any) -> torch.layout:
    """Same lookup as `torch.serialization._get_layout`, on a checked string."""
    if not isinstance(name, str) or name not in _layouts():
        raise ValueError(f"unknown torch layout {name!r}")
    return _layouts()[name]


def _mem_format(value: Any) -> _dcp_md._MEM_FORMAT_ENCODING:
    """An enum member by its int value; never the functional Enum API."""
    if type(value) is not int:
        raise ValueError(f"memory format encoding must be an int, not {type(value).__name__}")
    return _dcp_md._MEM_FORMAT_ENCODING(value)


def _posix_path(*parts: Any) -> pathlib.PosixPath:
    """A path object from its string parts; it touches no file."""
    if not all(isinstance(p, str) for p in parts):
        raise ValueError("PosixPath parts must be strings")
    return pathlib.PosixPath(*parts)


_ALLOWED: dict[tuple[str, str], Any] = {
    (_MD, "Metadata"): _dcp_md.Metadata,
    (_MD, "TensorStorageMetadata"): _dcp_md.TensorStorageMetadata,
    (_MD, "BytesStorageMetadata"): _dcp_md.BytesStorageMetadata,
    (_MD, "ChunkStorageMetadata"): _dcp_md.ChunkStorageMetadata,
    (_MD, "TensorProperties"): _dcp_md.TensorProperties,
    (_MD, "MetadataIndex"): _dcp_md.MetadataIndex,
    (_MD, "StorageMeta"): _dcp_md.StorageMeta,
    (_MD, "_MEM_FORMAT_ENCODING"): _mem_format,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _dcp_fs._StorageInfo,
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): _posix_path,
    ("pathlib._local", "PosixPath"): _posix_path,
}


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    return {k: v for k, v in vars(torch).items() if isinstance(v, torch.dtype)}


def allowed_globals() -> list[str]:
    """The `module.name` entries `load_metadata` admits (dtypes included), for docs and tests."""
    names = [f"{m}.{n}" for m, n in _ALLOWED]
    return sorted(names + [f"torch.{n}" for n in _dtypes()])


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the globals of DCP's metadata format; see the module docstring."""

    def __init__(self, file: io.BytesIO, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None and module == "torch":
            found = _dtypes().get(name)
        if found is None:
            raise CheckpointCorruptError(
                self._path,
                f"DCP metadata refers to {module}.{name}, which is not part of DCP's metadata "
                "format; refusing to unpickle it (it could run code)",
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointCorruptError(
            self._path, "DCP metadata holds a persistent id, which DCP never writes; refusing it"
        )


def _problem(exc: Exception) -> str:
    text = str(exc)
    if isinstance(exc, EOFError) or "truncated" in text:
        return f"DCP metadata is truncated ({type(exc).__name__}: {text or 'no more data'})"
    return f"DCP metadata cannot be unpickled ({type(exc).__name__}: {text})"


def load_metadata(
    data: bytes | bytearray | memoryview, path: str
) -> torch.distributed.checkpoint.metadata.Metadata:
    """Unpickle DCP metadata with an allowlist; raise CheckpointCorruptError(path, problem) for
    anything else, so a hostile or damaged `.metadata` never runs code or leaks another error."""
    raw = bytes(data)
    buffer = io.BytesIO(raw)
    try:
        result = _MetadataUnpickler(buffer, path).load()
    except CheckpointCorruptError:
        raise
    except Exception as exc:  # any pickle or wrapper failure means a damaged file
        raise CheckpointCorruptError(path, _problem(exc)) from exc
    if not isinstance(result, _dcp_md.Metadata):
        raise CheckpointCorruptError(
            path, f"DCP metadata holds a {type(result).__name__}, not a Metadata"
        )
    if buffer.tell() != len(raw):
        raise CheckpointCorruptError(path, "DCP metadata has trailing bytes after its pickle")
    return result


def check_complete(metadata: _dcp_md.Metadata, listed: Collection[str], path: str) -> None:
    """Every item `.metadata` describes has its bytes recorded, in a file the manifest lists.
    A save that lost a file yet wrote `.metadata` (a DCP writer thread's error was only
    printed: review 20) left items without data; DCP found that only halfway through the
    apply. Refused while preparing, the step is damaged (`fallback` passes over it)."""
    data = metadata.storage_data or {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, _dcp_md.TensorStorageMetadata):
            keys = [_dcp_md.MetadataIndex(fqn, torch.Size(c.offsets)) for c in md.chunks]
        else:
            keys = [_dcp_md.MetadataIndex(fqn)]
        for key in keys:
            info = data.get(key)
            if info is None:
                raise CheckpointCorruptError(path, f"DCP metadata records no data for {fqn!r}")
            if info.relative_path not in listed:
                raise CheckpointCorruptError(
                    path,
                    f"DCP metadata puts {fqn!r} in {info.relative_path}, a file the manifest "
                    "does not list",
                )
