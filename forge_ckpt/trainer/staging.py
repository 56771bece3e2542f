"""The trainer's in-memory snapshot: CPU copies of its state, in buffers reused between saves.

An async save must return only after the state is copied somewhere training cannot touch, and
that copy is all the loop waits for. The buffers are allocated on the first save (pinned when
the source is on a GPU, so the device-to-host copy runs at full speed) and reused for as long
as each tensor keeps its shape and dtype, so later saves copy without allocating.

DCP's `DefaultStager` does the same job, but torch 2.11 closes its internal stager after every
synchronous `stage()` call, which drops the cached buffers and breaks the second call
(`KeyError: <class 'type'>`). This module depends on nothing of DCP's staging.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor

Path = tuple[Any, ...]


class SnapshotBuffers:
    """Copies a state dict's tensors (plain or DTensor) into reused CPU buffers."""

    def __init__(self) -> None:
        self._buffers: dict[Path, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    @torch.no_grad()
    def copy(self, state: Any) -> Any:
        """A copy of `state` whose tensors live in this object's CPU buffers. Containers are
        rebuilt, other values deep-copied; the copy is complete when this returns."""
        used: dict[Path, torch.Tensor] = {}
        out = self._copy(state, (), used)
        if any(b.is_pinned() for b in used.values()):
            torch.cuda.synchronize()  # the pinned copies were issued non-blocking
        self._buffers = used  # buffers of tensors that are gone are released
        return out

    def _copy(self, obj: Any, path: Path, used: dict[Path, torch.Tensor]) -> Any:
        if isinstance(obj, DTensor):
            local = self._tensor(obj.to_local(), path, used)
            return DTensor.from_local(
                local,
                obj.device_mesh,
                obj.placements,
                run_check=False,
                shape=obj.shape,
                stride=obj.stride(),
            )
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path, used)
        if isinstance(obj, dict):
            return {k: self._copy(v, (*path, k), used) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, (*path, i), used) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return copy.deepcopy(obj)

    def _tensor(self, t: torch.Tensor, path: Path, used: dict[Path, torch.Tensor]) -> torch.Tensor:
        buf = self._buffers.get(path)
        pin = t.is_cuda
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.is_pinned() != pin:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        buf.copy_(t.detach(), non_blocking=pin)
        used[path] = buf
        return buf
