"""Policy weights by version, for generators that run behind the trainer (asynchronous RL).

A generator in an asynchronous RL job samples with weights up to `max_policy_lag` versions
older than the trainer's, so at a checkpoint it may hold several versions at once. Writing them
all from every generator would store the same tensors many times: the trainer's current version
is already in the step (the trainer's DCP shards), and an older version is the same on every
generator that holds it. `WeightVersions` is the part of a generator's state that says so:

- `put(v, weights)` when the driver pushes version `v`; `keep_from(v)` drops older versions;
- `state_dict(trainer_version, owner)` writes the trainer's version as a reference
  (`{"ref": "trainer", "version": v}`: "my weights are the trainer's version v"), an older
  version as tensors only when `owner` is true, else as a reference to the owner component;
- after a load, `missing()` names the versions to fetch and `fill(...)` checks each against
  what the step holds: a generator that says it holds trainer version v is refused (with
  `CheckpointMismatchError`) when the restored trainer is at another version.

Nothing here is specific to one app: an outside generator actor keeps a `WeightVersions`,
returns its `state_dict(...)` inside its own `state_dict()` and, after `coord.load()`, lets the
driver fill the references (`fill_from`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointMismatchError
from .immutable import immutable

Weights = Mapping[str, Any]  # parameter name -> tensor (never changed in place once put)
TRAINER = "trainer"


def trainer_ref(version: int) -> dict[str, Any]:
    """The reference written instead of weights equal to the trainer's version `version`."""
    return {"ref": TRAINER, "version": int(version)}


def owner_ref(version: int, owner: str) -> dict[str, Any]:
    """The reference written instead of weights that component `owner` stores in the step."""
    return {"ref": str(owner), "version": int(version)}


def is_ref(entry: Any) -> bool:
    return isinstance(entry, Mapping) and "ref" in entry and "version" in entry


class WeightVersions:
    """The weight versions one generator holds; see the module docstring."""

    # The entry helpers, for code that rewrites a saved state (a reshard rule).
    is_ref = staticmethod(is_ref)
    owner_ref = staticmethod(owner_ref)
    trainer_ref = staticmethod(trainer_ref)

    def __init__(self) -> None:
        self.held: dict[int, Weights] = {}
        self.refs: dict[int, dict[str, Any]] = {}  # restored references, not yet filled

    def put(self, version: int, weights: Weights) -> None:
        self.held[int(version)] = dict(weights)
        self.refs.pop(int(version), None)

    def get(self, version: int) -> Weights:
        if version in self.refs:
            ref = self.refs[version]
            raise RuntimeError(
                f"weights of version {version} were restored as a reference to {ref['ref']!r} "
                "and not filled yet: call fill_from() after load()"
            )
        return self.held[version]

    def has(self, version: int) -> bool:
        return version in self.held

    def keep_from(self, version: int) -> None:
        """Forget every version older than `version`."""
        self.held = {v: w for v, w in self.held.items() if v >= version}
        self.refs = {v: r for v, r in self.refs.items() if v >= version}

    def versions(self) -> list[int]:
        return sorted(set(self.held) | set(self.refs))

    def state_dict(self, trainer_version: int, owner: bool, owner_name: str) -> dict[str, Any]:
        """Per version: a trainer reference (v == `trainer_version`), the tensors (an older
        version and `owner`), or a reference to `owner_name`. A version newer than the
        trainer's cannot exist: it is refused, as it would mean the caller's version is stale."""
        out: dict[str, Any] = {}
        for v in self.versions():
            if v > trainer_version:
                raise ValueError(
                    f"a generator holds weights of version {v}, newer than the trainer's "
                    f"{trainer_version}: pass the trainer's current version"
                )
            if v == trainer_version:
                out[str(v)] = trainer_ref(v)
            elif owner:
                out[str(v)] = immutable(dict(self.get(v)))
            else:
                out[str(v)] = owner_ref(v, owner_name)
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.held, self.refs = {}, {}
        for key, entry in state.items():
            if is_ref(entry):
                self.refs[int(key)] = dict(entry)
            else:
                self.held[int(key)] = dict(entry)

    def missing(self) -> dict[int, str]:
        """version -> the component whose copy it must get ("trainer" or an owner's name)."""
        return {v: str(r["ref"]) for v, r in sorted(self.refs.items())}

    def fill(self, version: int, weights: Weights, source: str, source_version: int) -> None:
        """Fill a restored reference with `weights` that `source` holds as `source_version`;
        refused when they are not the version the reference names."""
        ref = self.refs.get(version)
        if ref is None:
            raise ValueError(f"version {version} is not a restored reference")
        if ref["ref"] != source or int(source_version) != version:
            raise CheckpointMismatchError(
                [
                    f"a generator's weights of version {version} refer to {ref['ref']!r}, but "
                    f"{source!r} holds version {source_version}"
                ],
                "load the step the generators were saved with (their weights are not in any "
                "other step)",
            )
        self.put(version, weights)
