"""Every path forge_ckpt builds, the manifest, the commit marker, and finding committed steps.

One checkpoint folder holds:

    <folder>/.forge_ckpt.lock           one writer per folder (see lock.py)
    <folder>/step-<N>/                   one step (TorchTitan's naming, so stock TorchTitan finds it)
        .metadata, __<r>_0.distcp        the trainer's DCP files (written by TorchTitan)
        trainer/rank-<r>.msgpack         each trainer rank's RNG streams
        actors/<name>.<replica>.msgpack  one file per actor replica
        manifest.json                    every file with size and crc32c, versions, extra
        COMMIT                           the marker: written last; names the manifest's crc32c

A step exists (for load, listing and retention) only if COMMIT parses and the manifest's crc32c
equals the one COMMIT records. This module is the only place that decides that.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import CheckpointCorruptError, InvalidNameError
from .storage import FileRecord, crc32c_of_bytes

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MARKER = "COMMIT"
LOCK = ".forge_ckpt.lock"
TRAINER = "trainer"
_STEP_RE = re.compile(r"^step-(\d+)$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def actor_file(name: str, replica: int) -> str:
    """Path of one actor replica's file, relative to the step folder."""
    return f"actors/{name}.{replica}.msgpack"


def trainer_rank_file(rank: int) -> str:
    return f"{TRAINER}/rank-{rank}.msgpack"


def check_name(name: Any) -> str:
    """Refuse names that could leave the step folder or collide with reserved files."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name:
        raise InvalidNameError(
            f"invalid component name {name!r}: use 1-128 letters, digits, '_', '-' or '.', "
            "starting with a letter or digit, without '..' or path separators"
        )
    if name == TRAINER:
        raise InvalidNameError(f"{name!r} is reserved for the trainer: use set_trainer()")
    return name


@dataclass
class Component:
    """One registered component as the manifest records it."""

    kind: str  # "trainer" | "actor"
    replicas: int  # trainer: world size
    files: list[FileRecord] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "replicas": self.replicas,
            "seconds": round(self.seconds, 6),
            "files": [f.to_dict() for f in self.files],
        }

    @classmethod
    def from_dict(cls, d: dict) -> Component:
        return cls(
            kind=d["kind"],
            replicas=int(d["replicas"]),
            files=[FileRecord.from_dict(f) for f in d["files"]],
            seconds=float(d.get("seconds", 0.0)),
        )


@dataclass
class Manifest:
    step: int
    components: dict[str, Component]
    extra: Any = None
    fingerprint: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    created: float = 0.0
    format_version: int = FORMAT_VERSION

    @property
    def files(self) -> list[FileRecord]:
        return [f for c in self.components.values() for f in c.files]

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_bytes(self) -> bytes:
        d = {
            "format_version": self.format_version,
            "step": self.step,
            "created": self.created,
            "fingerprint": self.fingerprint,
            "versions": self.versions,
            "extra": self.extra,
            "components": {k: c.to_dict() for k, c in sorted(self.components.items())},
        }
        return json.dumps(d, indent=1, sort_keys=False).encode()

    @classmethod
    def from_bytes(cls, data: bytes, path: str = MANIFEST) -> Manifest:
        try:
            d = json.loads(data)
            if d["format_version"] > FORMAT_VERSION:
                raise CheckpointCorruptError(
                    path,
                    f"format version {d['format_version']} is newer than this library "
                    f"({FORMAT_VERSION})",
                    "upgrade forge_ckpt to read it",
                )
            return cls(
                step=int(d["step"]),
                components={k: Component.from_dict(c) for k, c in d["components"].items()},
                extra=d.get("extra"),
                fingerprint=d.get("fingerprint"),
                versions=dict(d.get("versions", {})),
                created=float(d.get("created", 0.0)),
                format_version=int(d["format_version"]),
            )
        except CheckpointCorruptError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointCorruptError(path, f"manifest is not valid: {e}") from None


def marker_bytes(step: int, manifest_crc: str) -> bytes:
    return json.dumps({"step": step, "manifest_crc32c": manifest_crc}).encode()


def read_committed(path: str) -> Manifest:
    """The manifest of a committed step folder; CheckpointCorruptError if it is not one."""
    marker_path = os.path.join(path, MARKER)
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(marker_path, "rb") as f:
            marker = json.loads(f.read(4096))
        want_crc, want_step = str(marker["manifest_crc32c"]), int(marker["step"])
    except FileNotFoundError:
        raise CheckpointCorruptError(
            marker_path, "no commit marker: this step was never committed", "It cannot be loaded."
        ) from None
    except (ValueError, KeyError, TypeError):
        raise CheckpointCorruptError(marker_path, "commit marker is not valid") from None
    try:
        with open(manifest_path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointCorruptError(manifest_path, "manifest is missing") from None
    if crc32c_of_bytes(data) != want_crc:
        raise CheckpointCorruptError(
            manifest_path,
            f"manifest crc32c {crc32c_of_bytes(data)} differs from the marker's {want_crc}",
        )
    manifest = Manifest.from_bytes(data, manifest_path)
    if manifest.step != want_step or parse_step(os.path.basename(path)) != want_step:
        raise CheckpointCorruptError(marker_path, f"marker names step {want_step}, folder differs")
    return manifest


def parse_step(dirname: str) -> int | None:
    m = _STEP_RE.match(dirname)
    return int(m.group(1)) if m else None


def all_steps(folder: str) -> list[int]:
    """Every `step-N` folder, committed or not, ascending."""
    if not os.path.isdir(folder):
        return []
    steps = (parse_step(d) for d in os.listdir(folder))
    return sorted(s for s in steps if s is not None)


def marked_steps(folder: str) -> list[int]:
    """Steps whose folder holds a COMMIT file, valid or not, ascending.

    A crash can never leave a partial COMMIT (it is renamed into place), so a step with a
    marker was committed once: if its marker or manifest no longer checks out, it is a damaged
    committed step, kept for inspection and reported on load, never silently removed.
    """
    return [
        s for s in all_steps(folder) if os.path.exists(os.path.join(step_dir(folder, s), MARKER))
    ]


def is_committed(folder: str, step: int) -> bool:
    try:
        read_committed(step_dir(folder, step))
        return True
    except CheckpointCorruptError:
        return False


def committed_steps(folder: str) -> list[int]:
    """The single definition of which steps exist: folders with a valid marker, ascending."""
    return [s for s in all_steps(folder) if is_committed(folder, s)]
