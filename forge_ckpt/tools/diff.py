"""What differs between two committed steps, per component and per tensor, array or value.

A user asks "did the weights change?" or "which actor's state differs after a resume?". Two
steps are compared component by component (the trainer, each actor); within a component,
file by file:

- both manifests record the same cryptographic digest for a file: everything in it is
  unchanged, proven without reading it (`by: "digest"`; CRC32C is no proof and is not used);
- otherwise by value: DCP tensors are assembled one at a time from their chunks (whole, at
  most two tensors in memory), DCP's non-tensor entries compared as stored bytes (never
  unpickled), actor files decoded with forge_ckpt's own serializer (no pickle).

Tensors and arrays are equal when their shape, dtype and bits are (so NaN equals the same
NaN); a changed one reports the largest absolute difference when shape and dtype agree.
Reading is not verifying: run `forge-ckpt verify` for the integrity of every file.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from .. import serialization
from ..dcp.storage_io import METADATA
from ..steps import layout
from ..steps.signing import Signer
from ..storage import FileRecord, Storage
from .export import _assemble, _model_tensors, _read_metadata
from .report import finite

UNCHANGED, CHANGED, ADDED, REMOVED = "unchanged", "changed", "added", "removed"


@dataclass
class Entry:
    """One tensor, array or value: `key` inside `file` (None: the trainer's DCP state)."""

    file: str | None
    key: str
    status: str
    by: str  # "digest" | "value"
    kind: str = "value"  # "tensor" | "array" | "value" | "bytes"
    shape_a: list[int] | None = None
    shape_b: list[int] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    max_abs_diff: float | None = None


@dataclass
class ComponentDiff:
    name: str
    status: str
    entries: list[Entry] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys((UNCHANGED, CHANGED, ADDED, REMOVED), 0)
        for e in self.entries:
            out[e.status] += 1
        return out


@dataclass
class StepDiff:
    a: str
    b: str
    components: list[ComponentDiff]

    @property
    def same(self) -> bool:
        return all(c.status == UNCHANGED for c in self.components)

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "same": self.same,
                "components": [{"name": c.name, "status": c.status, "counts": c.counts(),
                                "entries": [_row(e) for e in c.entries]}
                               for c in self.components]}  # fmt: skip


def _row(e: Entry) -> dict[str, Any]:
    return {**asdict(e), "max_abs_diff": finite(e.max_abs_diff)}


@dataclass
class _Side:
    sub: Storage
    comp: layout.Component

    @property
    def recs(self) -> dict[str, FileRecord]:
        """The component's files by name, without the save attempt that wrote each (one
        replica's file has one name in any two steps)."""
        return {layout.logical_path(r.path): r for r in self.comp.files}


def diff_steps(
    folder_a: str | Storage,
    step_a: int,
    folder_b: str | Storage,
    step_b: int,
    signer: Signer | None = None,
) -> StepDiff:
    """Compare two committed steps (of one folder or of two: local, s3://)."""
    store_a, store_b = layout.as_storage(folder_a), layout.as_storage(folder_b)
    ma = layout.read_committed(store_a, step_a, signer)
    mb = layout.read_committed(store_b, step_b, signer)
    sub_a, sub_b = store_a.sub(layout.step_name(step_a)), store_b.sub(layout.step_name(step_b))
    out = []
    for name in sorted(set(ma.components) | set(mb.components)):
        if name not in mb.components:
            out.append(ComponentDiff(name, REMOVED))
        elif name not in ma.components:
            out.append(ComponentDiff(name, ADDED))
        else:
            a, b = _Side(sub_a, ma.components[name]), _Side(sub_b, mb.components[name])
            entries = list(_component(a, b))
            changed = any(e.status != UNCHANGED for e in entries)
            out.append(ComponentDiff(name, CHANGED if changed else UNCHANGED, entries))
    return StepDiff(sub_a.url, sub_b.url, out)


def _component(a: _Side, b: _Side) -> Iterator[Entry]:
    ra, rb = a.recs, b.recs
    if METADATA in ra or METADATA in rb:
        yield from _dcp(a, b)
    for path in sorted(p for p in set(ra) | set(rb) if p.endswith(".msgpack")):
        if path not in rb or path not in ra:
            yield Entry(path, "", REMOVED if path in ra else ADDED, "value")
        elif _same_digest([ra[path]], [rb[path]]):
            yield Entry(path, "", UNCHANGED, "digest")
        else:
            yield from _values(path, serialization.load_from(a.sub, ra[path].path, ra[path]),
                               serialization.load_from(b.sub, rb[path].path, rb[path]))  # fmt: skip


def _same_digest(a: list[FileRecord], b: list[FileRecord]) -> bool:
    """Every file has a digest on both sides and they are equal, name by name."""

    def named(recs: list[FileRecord]) -> list[tuple[str, str | None]]:
        return sorted((layout.logical_path(r.path), r.digest) for r in recs)

    return (
        len(a) == len(b) > 0
        and all(r.digest is not None for r in (*a, *b))
        and (named(a) == named(b))
    )


def _dcp(a: _Side, b: _Side) -> Iterator[Entry]:
    """The trainer's DCP state, key by key. `.metadata` itself differs between any two saves
    (it names its save), so digests prove a key unchanged when its bytes lie at the same
    places of files whose digests are equal."""
    ra, rb = a.recs, b.recs
    if METADATA not in ra or METADATA not in rb:
        yield Entry(None, METADATA, REMOVED if METADATA in ra else ADDED, "value")
        return
    meta_a, meta_b = _read_metadata(a.sub, ra), _read_metadata(b.sub, rb)
    ta = {t.name: t for t in _model_tensors(meta_a, a.sub, ra, keep=_every)}
    tb = {t.name: t for t in _model_tensors(meta_b, b.sub, rb, keep=_every)}
    ka, kb = meta_a.state_dict_metadata, meta_b.state_dict_metadata
    for key in sorted(set(ka) | set(kb)):
        if key not in kb or key not in ka:
            yield Entry(None, key, REMOVED if key in ka else ADDED, "value")
            continue
        by_digest = _same_places(meta_a, meta_b, key, ra, rb)
        if key in ta and key in tb:
            if by_digest:
                yield _tensor_entry(
                    None, key, _meta_tensor(ta[key]), _meta_tensor(tb[key]), "digest"
                )
            else:
                yield _tensor_entry(None, key, _assemble(a.sub, ta[key]), _assemble(b.sub, tb[key]))
        else:
            same = by_digest or _raw(a.sub, meta_a, key) == _raw(b.sub, meta_b, key)
            yield Entry(None, key, UNCHANGED if same else CHANGED,
                        "digest" if by_digest else "value", "bytes")  # fmt: skip


def _places(meta: Metadata, key: str) -> list[tuple[Any, ...]]:
    """Where DCP stored `key`: (chunk offsets, file, byte offset, length) per chunk."""
    out = []
    for index, info in meta.storage_data.items():
        if index.fqn == key:
            where = tuple(getattr(info, a, None) for a in ("relative_path", "offset", "length"))
            out.append((tuple(index.offset or ()), *where))
    return sorted(out, key=repr)


def _same_places(
    meta_a: Metadata,
    meta_b: Metadata,
    key: str,
    ra: dict[str, FileRecord],
    rb: dict[str, FileRecord],
) -> bool:
    """`key` lies at the same places of files whose digests are recorded and equal."""
    pa = _places(meta_a, key)
    if not pa or pa != _places(meta_b, key):
        return False
    files = {p[1] for p in pa}
    return all(
        f in ra and f in rb and ra[f].digest is not None and ra[f].digest == rb[f].digest
        for f in files
    )


def _every(meta: Metadata, fqn: str) -> bool:
    return True


def _meta_tensor(t: Any) -> torch.Tensor:
    """A shape-and-dtype stand-in (no data) for a tensor proven unchanged by digest."""
    return torch.empty(tuple(t.md.size), dtype=t.md.properties.dtype, device="meta")


def _raw(sub: Storage, meta: Metadata, key: str) -> bytes | None:
    """A non-tensor DCP entry's stored bytes (compared, never unpickled)."""
    md = meta.state_dict_metadata[key]
    if isinstance(md, TensorStorageMetadata):
        return None  # a tensor on one side only: reported as changed
    info = meta.storage_data.get(MetadataIndex(key))
    if info is None:
        return None
    return bytes(sub.read(info.relative_path, info.offset, info.offset + info.length))


def _tensor_entry(
    file: str | None, key: str, a: torch.Tensor, b: torch.Tensor, by: str = "value"
) -> Entry:
    e = Entry(file, key, UNCHANGED, by, "tensor", list(a.shape), list(b.shape),
              str(a.dtype).removeprefix("torch."), str(b.dtype).removeprefix("torch."))  # fmt: skip
    if by == "digest":
        return e
    if a.shape != b.shape or a.dtype != b.dtype:
        e.status = CHANGED
    elif not torch.equal(_bits(a), _bits(b)):
        e.status, e.max_abs_diff = CHANGED, _max_abs(a, b)
    return e


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    if a.dtype == torch.bool:
        return float((a != b).any())
    wide = torch.complex128 if a.is_complex() else torch.float64
    return float((a.to(wide) - b.to(wide)).abs().max())


def _values(file: str, a: Any, b: Any, key: str = "") -> Iterator[Entry]:
    """An actor file's state, leaf by leaf (dicts always opened; lists and tuples when
    they hold containers, tensors or arrays; other values compared whole)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=repr):
            sub = f"{key}.{k}" if key else str(k)
            if k not in b or k not in a:
                yield Entry(file, sub, REMOVED if k in a else ADDED, "value")
            else:
                yield from _values(file, a[k], b[k], sub)
    elif _is_seq(a) and _is_seq(b) and len(a) == len(b) and (_opens(a) or _opens(b)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from _values(file, x, y, f"{key}[{i}]")
    elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        yield _tensor_entry(file, key, a, b)
    elif isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        yield _array_entry(file, key, a, b)
    else:
        same = type(a) is type(b) and _equal(a, b)
        yield Entry(file, key, UNCHANGED if same else CHANGED, "value")


def _is_seq(x: Any) -> bool:
    return isinstance(x, (list, tuple))


def _opens(x: list | tuple) -> bool:
    return any(isinstance(v, (dict, list, tuple, torch.Tensor, np.ndarray)) for v in x)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (ValueError, TypeError, RuntimeError):  # e.g. containers holding arrays
        return repr(a) == repr(b)


def _array_entry(file: str, key: str, a: np.ndarray, b: np.ndarray) -> Entry:
    e = Entry(file, key, UNCHANGED, "value", "array", list(a.shape), list(b.shape),
              str(a.dtype), str(b.dtype))  # fmt: skip
    if a.shape != b.shape or a.dtype != b.dtype:
        e.status = CHANGED
    elif a.tobytes() != b.tobytes():
        e.status = CHANGED
        if a.size and a.dtype.kind in "biufc":
            wide = np.complex128 if a.dtype.kind == "c" else np.float64
            e.max_abs_diff = float(np.abs(a.astype(wide) - b.astype(wide)).max())
    return e
