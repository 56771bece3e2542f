"""Capture and restore every RNG stream a process uses.

Global streams (Python `random`, numpy's legacy global state, torch CPU, every CUDA device) and
any generator objects a component declares. Ray reuses worker processes, so an actor that draws
from a global stream must have that stream captured, or a resumed actor continues from whatever
an earlier task left behind.

The state returned is plain containers, tuples, ints and tensors/arrays: msgpack-serializable by
`forge_ckpt.serialization`.
"""

from __future__ import annotations

import hashlib
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


def derive(state: Mapping[str, Any], member: int) -> dict[str, Any]:
    """Fresh, distinct streams for member `member` (a replica or rank index) that did not exist
    when `state` was saved: every stream of `state` (globals and named generators, same names
    and kinds) is replaced by one seeded with sha256(member, stream name, saved state). So
    members added on resume (N -> M > N, member j >= N derives from saved member j mod N) never
    draw the same numbers as the member they derive from or as each other, and the rule is a
    pure function of the checkpoint: a resume with the same M derives the same streams."""
    base = _digest(state)

    def seed(name: str) -> int:
        h = hashlib.sha256(f"{member}:{name}:".encode() + base).digest()
        return int.from_bytes(h[:8], "little") >> 1

    out: dict[str, Any] = {
        "python": random.Random(seed("python")).getstate(),
        "numpy": np.random.RandomState(seed("numpy") % 2**32).get_state(),
        "torch_cpu": torch.Generator().manual_seed(seed("torch_cpu")).get_state(),
    }
    if "torch_cuda" in state:
        cuda = list(state["torch_cuda"])
        out["torch_cuda"] = [_cuda_state(seed(f"torch_cuda{i}"), s) for i, s in enumerate(cuda)]
    gens = state.get("generators") or {}
    out["generators"] = {n: _fresh(g, seed(f"generator:{n}")) for n, g in gens.items()}
    return out


def _fresh(saved: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """A state of the saved generator's kind, seeded with `seed`."""
    kind = saved.get("kind")
    if kind == "python":
        return _get(random.Random(seed))
    if kind == "numpy_generator":
        bitgen = getattr(np.random, saved["state"]["bit_generator"])
        return _get(np.random.Generator(bitgen(seed)))
    if kind == "numpy_randomstate":
        return _get(np.random.RandomState(seed % 2**32))
    if kind == "torch":
        device = str(saved.get("device", "cpu"))
        if device.startswith("cuda") and torch.cuda.is_available():
            return _get(torch.Generator(device=device).manual_seed(seed))
        return {"kind": "torch", "state": torch.Generator().manual_seed(seed).get_state(),
                "device": device}  # fmt: skip
    raise ValueError(f"cannot derive a stream for a generator of kind {kind!r}")


def _cuda_state(seed: int, saved: Any) -> Any:
    if torch.cuda.is_available():
        return torch.Generator(device="cuda").manual_seed(seed).get_state()
    return saved  # not restorable here anyway (`restore` skips CUDA without a device)


def _digest(obj: Any) -> bytes:
    """A canonical hash of a captured RNG state (tensors and arrays by their bytes)."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(b"T" + x.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(x, np.ndarray):
            h.update(b"A" + np.ascontiguousarray(x).tobytes())
        elif isinstance(x, Mapping):
            for k in sorted(x, key=str):
                h.update(b"K" + str(k).encode())
                walk(x[k])
        elif isinstance(x, list | tuple):
            h.update(b"L%d" % len(x))
            for v in x:
                walk(v)
        else:
            h.update(b"V" + repr(x).encode())

    walk(obj)
    return h.digest()
