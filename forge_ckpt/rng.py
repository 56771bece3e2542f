"""Capture and restore every RNG stream a process uses.

Global streams (Python `random`, numpy's legacy global state, torch CPU, every CUDA device) and
any generator objects a component declares. Ray reuses worker processes, so an actor that draws
from a global stream must have that stream captured, or a resumed actor continues from whatever
an earlier task left behind.

The state returned is plain containers, tuples, ints and tensors/arrays: msgpack-serializable by
`forge_ckpt.serialization`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

Generator = random.Random | np.random.Generator | np.random.RandomState | torch.Generator


def _get(gen: Generator) -> dict[str, Any]:
    if isinstance(gen, random.Random):
        return {"kind": "python", "state": gen.getstate()}
    if isinstance(gen, np.random.Generator):
        return {"kind": "numpy_generator", "state": gen.bit_generator.state}
    if isinstance(gen, np.random.RandomState):
        return {"kind": "numpy_randomstate", "state": gen.get_state()}
    if isinstance(gen, torch.Generator):
        return {"kind": "torch", "state": gen.get_state(), "device": str(gen.device)}
    raise TypeError(f"unsupported generator type {type(gen).__name__}")


def _set(gen: Generator, saved: Mapping[str, Any], name: str) -> None:
    kind = _get(gen)["kind"]
    if saved["kind"] != kind:
        raise TypeError(f"rng {name!r}: checkpoint holds a {saved['kind']} generator, got {kind}")
    if isinstance(gen, random.Random):
        gen.setstate(_as_tuple(saved["state"]))
    elif isinstance(gen, np.random.Generator):
        gen.bit_generator.state = dict(saved["state"])
    elif isinstance(gen, np.random.RandomState):
        gen.set_state(tuple(saved["state"]))
    else:
        gen.set_state(saved["state"])


def _as_tuple(state: Any) -> tuple:
    # random.setstate needs (version, tuple_of_ints, gauss_next)
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def capture(generators: Mapping[str, Generator] | None = None) -> dict[str, Any]:
    """Snapshot the global streams and the named generators."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = list(torch.cuda.get_rng_state_all())
    state["generators"] = {name: _get(g) for name, g in (generators or {}).items()}
    return state


def restore(state: Mapping[str, Any], generators: Mapping[str, Generator] | None = None) -> None:
    """Put every stream back as `capture` saw it; named generators must match by name."""
    random.setstate(_as_tuple(state["python"]))
    np.random.set_state(tuple(state["numpy"]))
    torch.random.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["torch_cuda"]))
    saved = state.get("generators", {})
    mine = dict(generators or {})
    missing = sorted(set(saved) ^ set(mine))
    if missing:
        raise KeyError(
            f"rng generators differ: checkpoint has {sorted(saved)}, this actor declares "
            f"{sorted(mine)}"
        )
    for name, gen in mine.items():
        _set(gen, saved[name], name)
