"""The `--json` output of `forge-ckpt`: one JSON object per command on stdout.

Every object carries `schema_version` (bumped on any change that could break a reader:
a removed or renamed field, a changed type or meaning; new fields do not bump it) and
`command`. A failure prints `{"schema_version", "command", "error"}` and exits non-zero.
docs/cli.md lists every field.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..steps import layout
from ..storage import Storage

SCHEMA_VERSION = 1


def dumps(command: str, body: dict[str, Any]) -> str:
    """The command's JSON object: schema_version and command first, then `body`."""
    return json.dumps(
        _keys({"schema_version": SCHEMA_VERSION, "command": command, **body}),
        indent=2,
        default=repr,  # whatever else json cannot encode (bytes, ...): its text
        allow_nan=False,
    )


def _keys(value: Any) -> Any:
    """Actor state may have tuple or bytes keys, which JSON objects cannot (their text), and
    NaN or infinite floats, which JSON has not ('nan', 'inf', '-inf')."""
    if isinstance(value, dict):
        return {
            k if isinstance(k, (str, int, float, bool)) or k is None else repr(k): _keys(v)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_keys(v) for v in value]
    return finite(value) if isinstance(value, float) else value


def finite(x: float | None) -> float | str | None:
    """JSON has no NaN or infinity: those become the strings 'nan', 'inf', '-inf'."""
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def step_row(store: Storage, step: int, size: int) -> dict[str, Any]:
    """One step of `list`: committed or why not, size, components, creation time."""
    from ..errors import CheckpointCorruptError

    row: dict[str, Any] = {"step": step, "committed": False, "problem": None, "size": size}
    try:
        m = layout.read_committed(store, step)
    except CheckpointCorruptError as e:
        row.update(problem=e.problem, components={}, created=None)
        return row
    comps = {k: {"kind": c.kind, "replicas": c.replicas} for k, c in m.components.items()}
    row.update(committed=True, components=comps, created=m.created)
    return row


def manifest_body(manifest: layout.Manifest) -> dict[str, Any]:
    """What `inspect` reports of a manifest (files get their `contents` added by the CLI)."""
    return {
        "step": manifest.step,
        "format_version": manifest.format_version,
        "size": manifest.nbytes,
        "fingerprint": manifest.fingerprint,
        "created": manifest.created,
        "generation": manifest.generation,
        "versions": manifest.versions,
        "extra": manifest.extra,
        "components": {
            name: {
                "kind": c.kind,
                "replicas": c.replicas,
                "seconds": c.seconds,
                "files": [f.to_dict() for f in c.files],
            }
            for name, c in manifest.components.items()
        },
    }
