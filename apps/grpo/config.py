"""The run's configuration: a YAML file, dotted `key=value` overrides, and a fingerprint.

The config is a plain nested dict. Overrides must name keys that already exist in the file (a
typo is an error, not a silently new key) and are parsed as YAML scalars, so `steps=40`,
`overlap=true` and `policy.temperature=0.7` get the types they look like.

The fingerprint identifies the run: a hash of every key that shapes what the run computes. Keys
that may change between a run and its resume (`RESUMABLE_KEYS`) are left out, so a job can be
resumed with more `steps` or another checkpoint interval, while a folder written by a run with
another seed or model is refused.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import yaml

# Keys that may change on resume without changing what the run computes up to the resumed step.
# The shape keys may change too (docs/elastic.md): `dataset.num_workers` (the dataset records
# what it served by index, so workers hold nothing; the change is logged), `dataset.replicas`
# (the dataset's reshard_states merges what the replicas served and deals out the rest of the
# epoch: every prompt still once per epoch, in another order within the epoch) and
# `trainer.world_size` (the trainer's shards are resharded on load; the gradient sum is then
# taken over another number of slices, so later floats can differ in the last bits).
RESUMABLE_KEYS = frozenset(
    {
        "run_dir",
        "steps",
        "fresh",
        "progress",
        "ray.num_cpus",
        "ray.address",
        "ray.placement",
        "recovery.max_restarts",
        "recovery.wait_s",
        "checkpoint.folder",
        "checkpoint.interval",
        "checkpoint.keep_last",
        "checkpoint.async_mode",
        "checkpoint.memory",
        "checkpoint.memory_copies",
        "checkpoint.sigterm_grace_s",
        "dataset.num_workers",
        "dataset.replicas",
        "trainer.world_size",
        "policy.replicas",  # async mode: in-flight requests re-dealt (docs/async_rl.md)
        "policy.token_cost_ms",
    }
)


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says which key."""


def load_config(path: str, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Read `path` and apply `key=value` overrides (dotted keys reach into sections)."""
    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        set_key(cfg, key.strip(), yaml.safe_load(raw) if raw.strip() else "")
    return cfg


def set_key(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    """Set an existing dotted key; unknown keys are refused with the known ones listed."""
    *parents, leaf = dotted.split(".")
    node = cfg
    for i, part in enumerate(parents):
        child = node.get(part)
        if not isinstance(child, dict):
            where = ".".join(parents[: i + 1])
            raise ConfigError(f"unknown config section {where!r} in override {dotted!r}")
        node = child
    if leaf not in node:
        known = ", ".join(sorted(flatten(cfg)))
        raise ConfigError(f"unknown config key {dotted!r}; known keys: {known}")
    node[leaf] = value


def flatten(cfg: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`."""
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def fingerprint(cfg: dict[str, Any]) -> str:
    """sha256 over the canonical JSON of every key outside `RESUMABLE_KEYS`."""
    kept = {k: v for k, v in flatten(cfg).items() if k not in RESUMABLE_KEYS}
    blob = json.dumps(kept, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def section(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """A copy of one section (actors receive only what they use)."""
    return copy.deepcopy(cfg.get(name, {}))
