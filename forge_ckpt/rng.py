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

_GLOBAL = ("python", "numpy", "torch_cpu")
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


def _set(gen: Generator, saved: Mapping[str, Any]) -> None:
    """Put a saved state into `gen`; `differences` has checked that it fits."""
    if isinstance(gen, random.Random):
        gen.setstate(_as_tuple(saved["state"]))
    elif isinstance(gen, np.random.Generator):
        gen.bit_generator.state = dict(saved["state"])
    elif isinstance(gen, np.random.RandomState):
        gen.set_state(tuple(saved["state"]))
    else:
        gen.set_state(saved["state"])


def _misfit(gen: Generator, saved: Any, name: str) -> str | None:
    """Why `saved` cannot be put into `gen` (checked before anything is restored)."""
    if not isinstance(saved, Mapping) or "state" not in saved:
        return f"rng {name!r}: the checkpoint's entry is not a generator state"
    live = _get(gen)
    if saved.get("kind") != live["kind"]:
        kind = saved.get("kind")
        return f"rng {name!r}: checkpoint holds a {kind} generator, this one is {live['kind']}"
    if live["kind"] == "numpy_generator":
        if not isinstance(saved["state"], Mapping):
            return f"rng {name!r}: the checkpoint's numpy generator state is not a mapping"
        want, got = saved["state"].get("bit_generator"), live["state"].get("bit_generator")
        if want != got:
            return f"rng {name!r}: checkpoint holds a numpy {want} bit generator, this one {got}"
    if live["kind"] == "torch":
        want, got = str(saved.get("device", "cpu")), live["device"]
        if want.split(":")[0] != got.split(":")[0]:
            return f"rng {name!r}: checkpoint holds a torch generator on {want}, this one on {got}"
    return None


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


def differences(state: Any, generators: Mapping[str, Generator] | None = None) -> list[str]:
    """Every reason `restore(state, generators)` would fail, each with its remedy; empty when
    it cannot fail. Loads call this while preparing, so a mismatch is refused before any
    component (or any stream of this one) is changed."""
    if not isinstance(state, Mapping) or not all(k in state for k in _GLOBAL):
        return ["the checkpoint's RNG state is not one forge_ckpt wrote (a stream is missing)"]
    saved = state.get("generators") or {}
    mine = dict(generators or {})
    out = []
    if set(saved) != set(mine):
        out.append(
            f"rng generators differ: checkpoint has {sorted(saved)}, this component declares "
            f"{sorted(mine)}; declare the same names in rng_generators() (a renamed generator "
            "keeps its saved name) or start this component fresh"
        )
    for name in sorted(set(saved) & set(mine)):
        line = _misfit(mine[name], saved[name], name)
        if line is not None:
            out.append(f"{line}; declare a generator of the saved kind under that name")
    cuda = state.get("torch_cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) > torch.cuda.device_count():
        out.append(
            f"rng: the checkpoint holds {len(cuda)} CUDA device streams, this process sees "
            f"{torch.cuda.device_count()} device(s); give it as many devices as when it saved"
        )
    return out


def restore(state: Mapping[str, Any], generators: Mapping[str, Generator] | None = None) -> None:
    """Put every stream back as `capture` saw it; named generators must match by name and
    kind. Checks everything first, so a mismatch changes no stream (ValueError)."""
    problems = differences(state, generators)
    if problems:
        raise ValueError("; ".join(problems))
    random.setstate(_as_tuple(state["python"]))
    np.random.set_state(tuple(state["numpy"]))
    torch.random.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["torch_cuda"]))
    saved = state.get("generators") or {}
    for name, gen in dict(generators or {}).items():
        _set(gen, saved[name])
