"""Export the trainer's model weights of a committed step as Hugging Face safetensors.

The trainer's DCP files hold model, optimizer, LR schedule and extra states, sharded over
however many ranks saved them. Serving stacks and HF tooling want the model alone, whole
tensors, in `model-00001-of-0000N.safetensors` files plus `model.safetensors.index.json`
(`metadata.total_size`, `weight_map`). The index is always written, also for one shard, so
consumers have a single way in.

Streaming: the plan (which tensor goes in which shard) comes from DCP's `.metadata` alone;
then each tensor is assembled from its chunks (byte ranges of the `.distcp` files, read
through the storage seam, so local folders and `s3://` both work), up to `max_shard_size`
bytes are buffered, written as one shard and freed. Peak memory is about twice one shard
(the tensors and their serialized bytes) plus one tensor.

What is verified: the step must be committed (`layout.read_committed`, with the signature
when a signer with keys is given); `.metadata` and every `.distcp` file that holds a model
chunk are checked whole against the manifest (size, CRC32C, and the digest when recorded)
before anything is written, so a damaged file fails the export with its name and OUT
unchanged. Those files are read twice (check, then the ranges); a file altered between the two
reads is not detected. `.metadata` is unpickled through the allowlist (`dcp_metadata`) and
each chunk decoded with `torch.load(weights_only=True)`, as DCP's own reader does.

Model tensors are the top-level tensor keys of TorchTitan's flattened state (`flat_state`
puts the model's FQNs there); optimizer, LR schedule, dataloader and extra states are nested
(`optimizer.state.0.weight.exp_avg`, ...), as DCP's `planner_data` records.
"""

from __future__ import annotations

import io
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..dcp.metadata import load_metadata
from ..dcp.storage_io import METADATA
from ..errors import CheckpointCorruptError, CheckpointError
from ..steps import layout
from ..steps.signing import Signer
from ..storage import FileRecord, Storage
from ..storage.base import CHUNK, Checksums, check_record, expected_algo
from .hf import HFModel, Shapes, asset_names, copy_assets, resolve

INDEX = "model.safetensors.index.json"
_SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
_SHARD_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
_NOT_MODEL = ("optimizer", "lr_scheduler", "dataloader")  # TorchTitan's own top-level keys
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
Progress = Callable[[int, int], None]  # (bytes done, bytes in all)
KEEP_NAMES = "torchtitan"  # hf=...: TorchTitan's names, also where the step records a model


@dataclass
class ExportResult:
    """What `export_safetensors` wrote (file names relative to OUT, index last; `assets`:
    files copied from the HF assets folder)."""

    step: int
    files: list[str]
    tensors: int
    total_size: int
    hf: str | None = None
    assets: list[str] = field(default_factory=list)


@dataclass
class _Tensor:
    name: str
    md: TensorStorageMetadata
    # (chunk, DCP's storage info: relative_path, offset, length)
    chunks: list[tuple[ChunkStorageMetadata, Any]] = field(default_factory=list)
    # what it becomes in the export: name -> (shape, dtype); itself unless converted to HF
    outputs: Shapes = field(default_factory=dict)

    def nbytes(self, dtype: torch.dtype | None) -> int:
        return sum(
            math.prod(shape) * _out_dtype(saved, dtype).itemsize
            for shape, saved in self.outputs.values()
        )


def parse_size(text: str) -> int:
    """'2GB' -> 2*10**9, '500MiB' -> 500*2**20, '1000' -> 1000 (HF's `max_shard_size`)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise ValueError(f"{text!r} is not a size (e.g. 2GB, 500MB, 1GiB, 4096)")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_dtype(name: str) -> torch.dtype:
    """A floating torch dtype by name ('bfloat16', 'float16', 'float32')."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{name!r} is not a floating torch dtype (e.g. bfloat16, float16)")
    return dtype


def _out_dtype(saved: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and saved.is_floating_point else saved


def export_safetensors(
    folder: str | Storage,
    step: int,
    out: str | Storage,
    *,
    max_shard_size: int = 2 * 10**9,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    signer: Signer | None = None,
    hf: str | HFModel | None = None,
    hf_config: str | None = None,
    progress: Progress | None = None,
) -> ExportResult:
    """Write step `step`'s model weights to `out` as sharded safetensors with an index.

    `dtype` converts floating tensors (others keep theirs). `out` must be empty, or hold an
    earlier export when `overwrite` (its index and shards are replaced; other files stay).
    `hf` (`FAMILY:FLAVOR`, e.g. `llama3:8B`, or an `HFModel`) writes Hugging Face names and
    layout through TorchTitan's adapter; without it, the step's `extra["hf_model"]` is used
    when the job recorded one (`hf="torchtitan"` keeps TorchTitan's names). `hf_config` copies config.json and the tokenizer files of a HF
    assets folder next to the weights. `progress(done_bytes, total_bytes)` is called after
    each tensor."""
    try:
        from safetensors.torch import save
    except ImportError:
        raise CheckpointError(
            "export needs the safetensors package: pip install safetensors"
        ) from None

    store = layout.as_storage(folder)
    manifest = layout.read_committed(store, step, signer)
    trainer = manifest.components.get(layout.TRAINER)
    sub = store.sub(layout.step_name(step))
    if trainer is None:
        raise CheckpointError(
            f"{sub.url}: step {step} has no trainer component: no model to export"
        )
    recs = {r.path: r for r in trainer.files}
    tensors = _model_tensors(_read_metadata(sub, recs), sub, recs)
    model = _hf_model(hf, manifest)
    tensors = _plan_outputs(tensors, model)
    assets = asset_names(hf_config) if hf_config is not None else []
    dst = layout.as_storage(out)
    _check_out(dst, overwrite)
    for path in sorted({info.relative_path for t in tensors for _, info in t.chunks}):
        _verify_whole(sub, recs[path])
    plan = _plan(tensors, max_shard_size, dtype)
    _remove_export(dst)
    dst.makedirs("")
    total = sum(t.nbytes(dtype) for t in tensors)
    convert = model.convert if model is not None else None
    weight_map = _write_shards(sub, dst, plan, dtype, save, convert, _Counter(total, progress))
    hf_name = model.name if model is not None else None
    index = _index_bytes(total, weight_map, manifest, hf_name)
    shards = sorted(set(weight_map.values()))
    _finish(dst, shards, index, hf_config, assets)
    return ExportResult(step, [*shards, INDEX], len(weight_map), total, hf_name, assets)


def _finish(
    dst: Storage, shards: list[str], index: bytes, hf_config: str | None, assets: list[str]
) -> None:
    """The assets, then the index last (atomically); on failure nothing written stays."""
    try:
        if hf_config is not None:
            copy_assets(hf_config, assets, dst)
        dst.publish(INDEX, index)
    except BaseException:
        for name in [*shards, *assets]:
            dst.delete(name)
        raise
    dst.sync_dir("")


def _hf_model(hf: str | HFModel | None, manifest: layout.Manifest) -> HFModel | None:
    """The model to convert to: the caller's, else the one the job recorded in `extra`;
    `KEEP_NAMES` keeps TorchTitan's names even then."""
    if hf is None and isinstance(manifest.extra, dict):
        recorded = manifest.extra.get("hf_model")
        hf = recorded if isinstance(recorded, str) else None
    return None if hf is None or hf == KEEP_NAMES else resolve(hf)


def _plan_outputs(tensors: list[_Tensor], model: HFModel | None) -> list[_Tensor]:
    """Each tensor's outputs; those that become nothing (a tied head) are left out."""
    shapes = {t.name: (tuple(t.md.size), t.md.properties.dtype) for t in tensors}
    plan = {k: {k: v} for k, v in shapes.items()} if model is None else model.plan(shapes)
    for t in tensors:
        t.outputs = plan[t.name]
    return [t for t in tensors if t.outputs]


@dataclass
class _Counter:
    total: int
    report: Progress | None
    done: int = 0

    def add(self, n: int) -> None:
        self.done += n
        if self.report is not None:
            self.report(self.done, self.total)


def _write_shards(
    sub: Storage,
    dst: Storage,
    plan: list[list[_Tensor]],
    dtype: torch.dtype | None,
    save: Any,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None,
    counter: _Counter,
) -> dict[str, str]:
    """Assemble, write and free one shard at a time; on failure remove what was written."""
    weight_map: dict[str, str] = {}
    written: list[str] = []
    try:
        for i, group in enumerate(plan, 1):
            name = _SHARD_NAME.format(i, len(plan))
            written.append(name)  # before the write: a half-written shard is removed too
            shard: dict[str, torch.Tensor] = {}
            for t in group:
                whole = _assemble(sub, t)
                parts = {t.name: whole} if convert is None else convert(t.name, whole)
                del whole
                shard.update({k: v.to(_out_dtype(v.dtype, dtype)) for k, v in parts.items()})
                counter.add(t.nbytes(dtype))
            data = save(shard, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            del shard
            dst.write(name, data)
    except BaseException:
        for name in written:
            dst.delete(name)
        raise
    return weight_map


def _index_bytes(
    total: int, weight_map: dict[str, str], manifest: layout.Manifest, hf: str | None
) -> bytes:
    source: dict[str, Any] = {"step": manifest.step, "fingerprint": manifest.fingerprint}
    if hf is not None:
        source["hf_model"] = hf
    meta = {"total_size": total, "forge_ckpt": source}
    return json.dumps(
        {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}, indent=2
    ).encode()


def _read_metadata(sub: Storage, recs: dict[str, FileRecord]) -> Metadata:
    if METADATA not in recs:
        raise CheckpointCorruptError(sub.where(METADATA), "not listed in the manifest")
    data = sub.read_verified(METADATA, recs[METADATA])
    return load_metadata(data, sub.where(METADATA))


def _is_model_key(meta: Metadata, fqn: str) -> bool:
    planner = meta.planner_data if isinstance(meta.planner_data, dict) else {}
    path = planner.get(fqn, (fqn,))
    return len(path) == 1 and str(path[0]).split(".")[0] not in _NOT_MODEL


def _model_tensors(
    meta: Metadata,
    sub: Storage,
    recs: dict[str, FileRecord],
    keep: Callable[[Metadata, str], bool] = _is_model_key,
) -> list[_Tensor]:
    """Every model tensor (every tensor that `keep`s) with the storage location of each of
    its chunks, checked."""
    where = sub.where(METADATA)
    out = []
    for fqn, md in sorted(meta.state_dict_metadata.items()):
        if not isinstance(md, TensorStorageMetadata) or not keep(meta, fqn):
            continue
        t = _Tensor(fqn, md)
        for chunk in md.chunks:
            info = meta.storage_data.get(MetadataIndex(fqn, chunk.offsets))
            if not all(hasattr(info, a) for a in ("relative_path", "offset", "length")):
                raise CheckpointCorruptError(where, f"no storage location for a chunk of {fqn}")
            if info.relative_path not in recs:
                raise CheckpointCorruptError(
                    sub.where(info.relative_path), f"holds {fqn} but is not in the manifest"
                )
            if info.transform_descriptors:
                raise CheckpointError(f"{where}: {fqn} is stored with transforms "
                                      f"{info.transform_descriptors}, which export does not read")  # fmt: skip
            if len(chunk.offsets) != len(md.size) or any(
                o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, md.size, strict=True)
            ):
                raise CheckpointCorruptError(where, f"a chunk of {fqn} lies outside the tensor")
            t.chunks.append((chunk, info))
        if sum(c.sizes.numel() for c in md.chunks) != md.size.numel():
            raise CheckpointCorruptError(where, f"the chunks of {fqn} do not cover it")
        out.append(t)
    if not out:
        raise CheckpointError(f"{where}: the trainer state holds no model tensors")
    return out


def _check_out(dst: Storage, overwrite: bool) -> None:
    present = [p for p, _ in dst.walk("")]
    if not present:
        return
    if not overwrite:
        raise CheckpointError(f"{dst.url} is not empty ({len(present)} files, e.g. "
                              f"{present[0]}): pass overwrite=True (--overwrite) to replace "
                              "an export there")  # fmt: skip


def _remove_export(dst: Storage) -> None:
    """The index first: a reader never finds an index that names missing shards."""
    dst.delete(INDEX)
    for name in dst.list(""):
        if _SHARD_RE.match(name):
            dst.delete(name)


def _verify_whole(sub: Storage, rec: FileRecord) -> None:
    """Check a whole file against its record, holding at most CHUNK bytes of it."""
    if sub.local_path() is not None:
        sub.verify(rec.path, rec)  # memory-mapped
        return
    sums, pos = Checksums(expected_algo(rec)), 0
    try:
        while pos <= rec.size:
            data = sub.read(rec.path, pos, pos + CHUNK)
            sums.update(data)
            pos += len(data)
            if len(data) < CHUNK:
                break
    except FileNotFoundError:
        raise CheckpointCorruptError(sub.where(rec.path), "file is missing") from None
    check_record(sub.where(rec.path), sums.size, sums.crc, rec, sums.record(rec.path))


def _plan(tensors: list[_Tensor], limit: int, dtype: torch.dtype | None) -> list[list[_Tensor]]:
    """Greedy shards of at most `limit` bytes; a larger tensor gets a shard of its own."""
    shards: list[list[_Tensor]] = []
    size = 0
    for t in tensors:
        n = t.nbytes(dtype)
        if not shards or size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


def _assemble(sub: Storage, t: _Tensor) -> torch.Tensor:
    """One whole tensor from its chunks, each checked against what `.metadata` says."""
    full = torch.empty(tuple(t.md.size), dtype=t.md.properties.dtype)
    for chunk, info in t.chunks:
        where = sub.where(info.relative_path)
        span = f"{t.name} at bytes {info.offset}-{info.offset + info.length}"
        raw = sub.read(info.relative_path, info.offset, info.offset + info.length)
        try:
            part: Any = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as e:  # any decoding failure means damaged bytes
            raise CheckpointCorruptError(where, f"{span} cannot be decoded ({e})") from None
        if (
            not isinstance(part, torch.Tensor)
            or part.shape != chunk.sizes
            or part.dtype != full.dtype
        ):
            raise CheckpointCorruptError(where, f"{span} is not the chunk .metadata describes")
        full[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))] = part
    return full
