"""Does a `forge-ckpt export --hf llama3:debugmodel` folder compute what TorchTitan computes?

tests/test_export_hf.py proves the export equals TorchTitan's own `to_hf` and loads back
bitwise; this checks the meaning: Hugging Face's `LlamaForCausalLM` (transformers), loaded
from the export, and TorchTitan's llama3 model, loaded from the same files through `from_hf`,
give the same logits. Not part of the test suite: it needs transformers, and TorchTitan's
flex attention compiles for minutes on a CPU.

    forge-ckpt export FOLDER/step-N out/ --hf llama3:debugmodel
    python scripts/check_hf_logits.py out/        # exit 1 if the logits differ
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file


def read_export(folder: str) -> dict[str, torch.Tensor]:
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        out.update(load_file(os.path.join(folder, shard)))
    return out


def hf_llama_debugmodel() -> torch.nn.Module:
    """transformers' Llama with TorchTitan's llama3 `debugmodel` hyperparameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    config = LlamaConfig(hidden_size=256, num_attention_heads=16, num_key_value_heads=16,
                         num_hidden_layers=6, intermediate_size=768, vocab_size=2048,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         max_position_embeddings=131072, rope_scaling=rope)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "export", help="a folder written by forge-ckpt export --hf llama3:debugmodel"
    )
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    from torchtitan.models.llama3 import model_registry

    weights = read_export(args.export)
    hf = hf_llama_debugmodel()
    hf.load_state_dict(weights, strict=True)
    spec = model_registry("debugmodel")
    titan = spec.model.build().eval()
    titan.load_state_dict(spec.state_dict_adapter(spec.model, None).from_hf(dict(weights)))
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(32).repeat(2, 1)
    with torch.no_grad():
        want = titan(tokens, positions, titan.get_attention_masks(positions))
        got = hf(tokens).logits
    diff = float((got - want).abs().max())
    print(f"logits {tuple(got.shape)}: max |HF - TorchTitan| = {diff:.3g} "
          f"(largest logit {float(want.abs().max()):.3g})")  # fmt: skip
    return 0 if diff <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
