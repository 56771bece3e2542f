"""Hugging Face names and layout for an export, through TorchTitan's own state dict adapters.

TorchTitan saves its parameter names (`layers.0.attention.qkv_linear.wq.weight`); the HF
loader and inference engines want HF's (`model.layers.0.self_attn.q_proj.weight`), with Q and
K rows permuted for Llama's rotary layout, tied heads dropped and MoE experts split. Every
TorchTitan model family ships that mapping as `ModelSpec.state_dict_adapter` (`to_hf` /
`from_hf`); this module only drives it, never re-implements it.

The adapters convert a whole state dict at once; export streams. So each TorchTitan tensor
is passed to `to_hf` alone, and the result is checked against a dry run of the whole state
dict on `meta` tensors (no memory): if the adapter ever needs two TorchTitan tensors for one
HF tensor, the per-tensor results differ from the whole-dict ones and the export refuses
before writing anything, instead of writing a wrong model. The same dry run gives every
HF tensor's shape and dtype, so shards are planned before any data is read.

A model named `FAMILY:FLAVOR` (e.g. `llama3:8B`) is looked up in `torchtitan.models.FAMILY`'s
`model_registry`; its config (heads, dims) drives the permutations, so the step's model
tensors are compared with that flavor's and a mismatch is refused with the first difference.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointError
from ..storage import Storage, open_storage

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]
# What a HF assets folder (config.json and tokenizer) holds besides weights: copied by
# `--hf-config`; weights and their index are never copied from there.
ASSET_NAMES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)


@dataclass
class HFModel:
    """A TorchTitan state dict adapter plus what it needs to be driven one tensor at a time.

    `adapter`: anything with `to_hf(dict) -> dict` (a TorchTitan `BaseStateDictAdapter`).
    `expected`: the TorchTitan model's tensor names and shapes, to refuse a step of another
    model (None: not checked)."""

    name: str
    adapter: Any
    expected: dict[str, tuple[int, ...]] | None = None
    _plan: dict[str, Shapes] = field(default_factory=dict, repr=False)

    @classmethod
    def from_spec(cls, name: str, model_config: Any, adapter_cls: Callable[..., Any]) -> HFModel:
        """An adapter for a model config of one's own (a TorchTitan `BaseModel.Config`)."""
        with torch.device("meta"):
            model = model_config.build()
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        return cls(name, adapter_cls(model_config, None), expected)

    def plan(self, shapes: Shapes) -> dict[str, Shapes]:
        """For each TorchTitan tensor, the HF tensors (name -> shape, dtype) it becomes."""
        self._check_model(shapes)
        meta = {k: torch.empty(s, dtype=d, device="meta") for k, (s, d) in shapes.items()}
        try:
            whole = _shapes(self.adapter.to_hf(dict(meta)))
            each = {k: _shapes(self.adapter.to_hf({k: t})) for k, t in meta.items()}
        except Exception as e:  # an adapter's own error: name the model and the cause
            raise CheckpointError(
                f"{self.name}: TorchTitan's adapter cannot convert this step's model ({e!r})"
            ) from None
        merged: Shapes = {}
        for outs in each.values():
            merged.update(outs)
        if merged != whole:
            diff = sorted(set(merged) ^ set(whole)) or sorted(
                k for k in whole if merged.get(k) != whole[k]
            )
            raise CheckpointError(
                f"{self.name}: the adapter's HF tensors depend on several TorchTitan tensors "
                f"at once (e.g. {diff[:3]}), which a streaming export cannot do"
            )
        self._plan = each
        return each

    def convert(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The HF tensors of one TorchTitan tensor, each contiguous and owning its memory
        (safetensors refuses views into a shared buffer)."""
        out = {}
        for key, value in self.adapter.to_hf({name: tensor}).items():
            value = value.contiguous()
            if value.untyped_storage().nbytes() != value.nbytes:
                value = value.clone()
            out[key] = value
        if _shapes(out) != self._plan[name]:
            raise CheckpointError(f"{self.name}: {name} converted differently than planned")
        return out

    def _check_model(self, shapes: Shapes) -> None:
        if self.expected is None:
            return
        got = {k: s for k, (s, _) in shapes.items()}
        if got == self.expected:
            return
        missing = sorted(set(self.expected) - set(got))
        extra = sorted(set(got) - set(self.expected))
        wrong = sorted(k for k in set(got) & set(self.expected) if got[k] != self.expected[k])
        detail = (
            f"missing {missing[:3]}" if missing
            else f"unexpected {extra[:3]}" if extra
            else f"{wrong[0]} is {list(got[wrong[0]])}, {self.name} has "
                 f"{list(self.expected[wrong[0]])}"
        )  # fmt: skip
        raise CheckpointError(
            f"the step's model is not {self.name}: {detail}; name the flavor it was trained "
            "with (--hf FAMILY:FLAVOR)"
        )


def _shapes(sd: dict[str, Any]) -> Shapes:
    return {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}


def resolve(spec: str | HFModel) -> HFModel:
    """`FAMILY:FLAVOR` (e.g. `llama3:8B`, `qwen3:0.6B`) through TorchTitan's model registry."""
    if isinstance(spec, HFModel):
        return spec
    family, _, flavor = spec.partition(":")
    try:
        module = importlib.import_module(f"torchtitan.models.{family}")
    except ModuleNotFoundError as e:
        if e.name and (e.name == f"torchtitan.models.{family}" or family.startswith(e.name)):
            raise CheckpointError(f"{family!r} is not a TorchTitan model family "
                                  "(e.g. llama3, qwen3, deepseek_v3)") from None  # fmt: skip
        raise CheckpointError(
            f"importing torchtitan.models.{family} needs {e.name} (pip install {e.name})"
        ) from None
    flavors = sorted(_flavors(module))
    if flavor not in flavors:
        raise CheckpointError(
            f"{spec!r}: name the model as {family}:FLAVOR, FLAVOR one of {flavors}"
        )
    model_spec = module.model_registry(flavor)
    if model_spec.state_dict_adapter is None:
        raise CheckpointError(f"TorchTitan's {family} has no Hugging Face state dict adapter")
    return HFModel.from_spec(spec, model_spec.model, model_spec.state_dict_adapter)


def _flavors(module: Any) -> list[str]:
    """The flavor names of a family (its `<family>_configs` dict)."""
    for attr, value in vars(module).items():
        if attr.endswith("_configs") and isinstance(value, dict):
            return list(value)
    return []


def asset_names(src: str) -> list[str]:
    """The config and tokenizer files of a HF assets folder (local or s3://); refuses a
    folder without config.json (probably not a HF assets folder)."""
    store = open_storage(src)
    present = set(store.list(""))
    if "config.json" not in present:
        raise CheckpointError(
            f"{store.url} has no config.json: --hf-config takes a Hugging Face assets folder "
            "(config.json, tokenizer files), e.g. one from `huggingface-cli download`"
        )
    return [n for n in ASSET_NAMES if n in present]


def copy_assets(src: str, names: list[str], dst: Storage) -> None:
    """Copy the named files of the assets folder `src` into the export (small files)."""
    store = open_storage(src)
    for name in names:
        dst.write(name, bytes(store.read(name)))
