"""Every path forge_ckpt builds, the manifest, the commit marker, and finding committed steps.

One checkpoint folder (a local path or an `s3://bucket/prefix`) holds:

    <folder>/.forge_ckpt.lease           who may write the folder (see lock.py)
    <folder>/step-<N>/                   one step (TorchTitan's naming, so stock TorchTitan finds it)
        .metadata, __<r>_<k>.distcp      the trainer's DCP files (standard DCP)
        trainer/rank-<r>.msgpack         each trainer rank's RNG streams
        actors/<name>.<replica>.<attempt>.msgpack
                                         one file per actor replica, named for the save
                                         attempt that wrote it (actor_file)
        manifest.json                    every file with size and crc32c, versions, extra
        COMMIT                           the marker: created last; names the manifest's crc32c
    <folder>/quarantine/step-<N>.<time>/ a damaged committed step that `fallback` passed over

A step exists (for load, listing and retention) only if COMMIT parses, the manifest's crc32c
equals the one COMMIT records, and the folder's lease records the step as committed by the
lease generation that COMMIT names: a COMMIT that the lease does not record is a commit that
never completed (its writer lost the lease, or stopped between the marker and the record) and
counts for nobody. A folder whose
lease has no record (no lease, or a lease of an earlier release) counts every COMMIT, as
before. This module is the only place that decides that.
"""

from __future__ import annotations

import errno
import json
import posixpath
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointCorruptError, InvalidNameError
from ..storage import FileRecord, Storage, crc32c_of_bytes, join, open_storage
from .lease_record import parse_lease, parse_record
from .signing import Signer

FORMAT_VERSION = 2  # 2: lease generation in manifest and marker (1 is still read)
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
MARKER = "COMMIT"
LEASE = ".forge_ckpt.lease"
QUARANTINE = "quarantine"
TRAINER = "trainer"
ACTORS = "actors"
_STEP_RE = re.compile(r"^step-(\d+)$")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # fullmatch: no trailing "\n"


def step_name(step: int) -> str:
    return f"step-{step}"


def step_dir(folder: str, step: int) -> str:
    """The URL (or absolute path) of a step folder."""
    return join(folder, step_name(step))


def actor_file(name: str, replica: int, attempt: str | None = None) -> str:
    """Path of one actor replica's file, relative to the step folder. `attempt` names the save
    attempt that writes it (`g<lease generation>s<save number>`): a write of an aborted attempt,
    or of a job that lost the lease, that lands late lands beside the step's files, never on
    one of them (docs/protocol.md, rule 9). None: the name a step of an earlier release has."""
    return f"{ACTORS}/{name}.{replica}{'.' + attempt if attempt else ''}.msgpack"


def attempt_name(generation: int, number: int) -> str:
    return f"g{generation}s{number}"


_ACTOR_FILE_RE = re.compile(
    ACTORS + r"/(?P<name>.+)\.(?P<replica>\d+)(?:\.(?P<attempt>g\d+s\d+))?\.msgpack", re.DOTALL
)  # fullmatch


def replica_files(component: Component, name: str) -> dict[int, FileRecord]:
    """The file of each replica of actor component `name` in a manifest, by replica index
    (whatever attempt wrote it)."""
    out = {}
    for f in component.files:
        m = _ACTOR_FILE_RE.fullmatch(f.path)
        if m is not None and m["name"] == name:
            out[int(m["replica"])] = f
    return out


def other_attempts(manifest: Manifest, names: Iterable[str]) -> list[str]:
    """Of `names` (a committed step's `actors/` folder listed), the files of a replica that
    the manifest names another save attempt's file for: late writes of aborted attempts.
    Anything else (a replica or component the manifest does not name, a name that is not an
    actor file) is not taken for one: a damaged manifest must not make its data a stray."""
    kept = {
        (name, i): rec.path
        for name, comp in manifest.components.items()
        for i, rec in replica_files(comp, name).items()
    }
    out = []
    for n in names:
        m = _ACTOR_FILE_RE.fullmatch(f"{ACTORS}/{n}")
        own = None if m is None else kept.get((m["name"], int(m["replica"])))
        if m is not None and m["attempt"] is not None and own not in (None, m.group(0)):
            out.append(m.group(0))
    return out


def logical_path(path: str) -> str:
    """`path` without the save attempt in its name: one replica's file in any two steps."""
    m = _ACTOR_FILE_RE.fullmatch(path)
    if m is None or m["attempt"] is None:
        return path
    return actor_file(m["name"], int(m["replica"]))


def trainer_rank_file(rank: int) -> str:
    return f"{TRAINER}/rank-{rank}.msgpack"


def check_name(name: Any) -> str:
    """Refuse names that could leave the step folder or collide with reserved files."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise InvalidNameError(
            f"invalid component name {name!r}: use 1-128 letters, digits, '_', '-' or '.', "
            "starting with a letter or digit, without '..' or path separators"
        )
    if name == TRAINER:
        raise InvalidNameError(f"{name!r} is reserved for the trainer: use set_trainer()")
    return name


def check_relpath(path: str, where: str) -> str:
    """A file path from a manifest must stay inside its step folder."""
    norm = posixpath.normpath(path) if path else ""
    if (
        not path
        or path != norm
        or path.startswith("/")
        or "\\" in path
        or norm.split("/")[0] == ".."
        or "\x00" in path
    ):
        raise CheckpointCorruptError(
            where, f"file path {path!r} is not a plain relative path inside the step folder"
        )
    return path


@dataclass
class Component:
    """One registered component as the manifest records it."""

    kind: str  # "trainer" | "actor"
    replicas: int  # trainer: world size
    files: list[FileRecord] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "replicas": self.replicas,
            "seconds": round(self.seconds, 6),
            "files": [f.to_dict() for f in self.files],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> Component:
        files = [FileRecord.from_dict(f) for f in d["files"]]
        for f in files:
            check_relpath(f.path, where)
        return cls(
            kind=str(d["kind"]),
            replicas=int(d["replicas"]),
            files=files,
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
    generation: int = 0  # the writer's lease generation (fencing token)
    format_version: int = FORMAT_VERSION
    # Steps of an abandoned branch this step replaces (rollback): (step, their `created`).
    supersedes: list[tuple[int, float]] = field(default_factory=list)

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
            "generation": self.generation,
            "fingerprint": self.fingerprint,
            "versions": self.versions,
            "extra": self.extra,
            "components": {k: c.to_dict() for k, c in sorted(self.components.items())},
        }
        if self.supersedes:
            d["supersedes"] = [list(p) for p in self.supersedes]
        return json.dumps(d, indent=1, sort_keys=False).encode()

    @classmethod
    def from_bytes(cls, data: bytes, path: str = MANIFEST) -> Manifest:
        try:
            d = json.loads(data)
            version = int(d["format_version"])
            if version not in READABLE_VERSIONS:
                raise CheckpointCorruptError(
                    path,
                    f"format version {version} is not one this library reads ({READABLE_VERSIONS})",
                    "upgrade forge_ckpt to read it" if version > FORMAT_VERSION else None,
                )
            return cls(
                step=int(d["step"]),
                components={k: Component.from_dict(c, path) for k, c in d["components"].items()},
                extra=d.get("extra"),
                fingerprint=d.get("fingerprint"),
                versions=dict(d.get("versions", {})),
                created=float(d.get("created", 0.0)),
                generation=int(d.get("generation", 0)),
                format_version=version,
                supersedes=[(int(a), float(b)) for a, b in d.get("supersedes", [])],
            )
        except CheckpointCorruptError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointCorruptError(path, f"manifest is not valid: {e}") from None


def marker_bytes(
    step: int, manifest_crc: str, generation: int = 0, signature: str | None = None
) -> bytes:
    marker: dict[str, Any] = {
        "step": step,
        "manifest_crc32c": manifest_crc,
        "generation": generation,
    }
    if signature is not None:
        marker["signature"] = signature  # HMAC of the manifest (see signing.py)
    return json.dumps(marker).encode()


def as_storage(folder: str | Storage) -> Storage:
    return folder if isinstance(folder, Storage) else open_storage(folder)


def marker_generation(marker: bytes | bytearray) -> int | None:
    """The lease generation a COMMIT names (0: a version 1 marker); None if it does not parse
    (a damaged marker: read_committed says so)."""
    try:
        d = json.loads(marker)
        return int(d.get("generation", 0)) if isinstance(d, dict) else None
    except (ValueError, TypeError):
        return None


@dataclass(frozen=True)
class Fence:
    """Which COMMIT markers count, as the folder's lease recorded them when it was read.

    `record`: step -> lease generation of the COMMIT that committed it (None: whichever is
    there). None: the folder has no record (no lease, or one written by a release before
    the record existed): every COMMIT counts. A damaged lease is an error, never "no
    record"."""

    record: Mapping[int, int | None] | None = None

    def admits(self, step: int) -> bool:
        """Whether a COMMIT of `step` can count at all (cheap: no read)."""
        return self.record is None or step in self.record

    def problem(self, step: int, marker: bytes | bytearray) -> str | None:
        """Why this COMMIT of `step` does not make it committed (None: it does, or it is
        damaged, which read_committed reports)."""
        if self.record is None:
            return None
        if step not in self.record:
            return (
                "commit marker is not recorded in the folder's lease: a commit that never "
                "completed (its writer lost the lease, or stopped before recording it), so "
                "this step was never committed"
            )
        want, got = self.record[step], marker_generation(marker)
        if want is None or got is None or got == want:
            return None
        return (
            f"commit marker of lease generation {got}, but the lease recorded this step's "
            f"commit by generation {want}: a late write of a writer that had lost the lease, "
            "so it does not count"
        )


NOT_COMMITTED_HINT = (
    "It cannot be loaded; the job that holds the folder removes it (or run `forge-ckpt gc`)."
)


def read_fence(folder: str | Storage) -> Fence:
    """The folder's commit record, read from its lease now. A damaged lease raises
    CheckpointLeaseCorruptError: counting every COMMIT instead would admit the late markers
    of writers that had lost the lease."""
    store = as_storage(folder)
    try:
        data = store.read(LEASE)
    except FileNotFoundError:
        return Fence()
    return Fence(parse_record(parse_lease(data, store.where(LEASE))))


def _counts(store: Storage, step: int, fence: Fence) -> bool:
    """A COMMIT of `step` is there and the fence does not rule it out (it may be damaged)."""
    if not fence.admits(step):
        return False
    path = f"{step_name(step)}/{MARKER}"
    if fence.record is None:
        return store.exists(path)
    try:
        return fence.problem(step, store.read(path, 0, 4096)) is None
    except FileNotFoundError:
        return False


def record_of_markers(folder: str | Storage) -> dict[int, int | None]:
    """A commit record of every step that has a COMMIT now: what a job taking over a folder
    without a record (an earlier release's) accepts, since every COMMIT counted there."""
    store = as_storage(folder)
    record = {}
    for s in all_steps(store):
        try:
            record[s] = marker_generation(store.read(f"{step_name(s)}/{MARKER}", 0, 4096))
        except FileNotFoundError:
            continue
    return record


def read_committed(
    folder: str | Storage, step: int, signer: Signer | None = None, fence: Fence | None = None
) -> Manifest:
    """The manifest of a committed step; CheckpointCorruptError if it is not one (or, with a
    signer that has keys, if its signature does not check out). `fence`: the folder's commit
    record if the caller already read it (else it is read here, before the marker)."""
    store = as_storage(folder)
    fence = read_fence(store) if fence is None else fence
    marker_path, manifest_path = f"{step_name(step)}/{MARKER}", f"{step_name(step)}/{MANIFEST}"
    try:
        raw = store.read(marker_path, 0, 4096)
        problem = fence.problem(step, raw)
        if problem is not None:
            raise CheckpointCorruptError(store.where(marker_path), problem, NOT_COMMITTED_HINT)
        marker = json.loads(raw)
        want_crc, want_step = str(marker["manifest_crc32c"]), int(marker["step"])
        signature = marker.get("signature")
    except FileNotFoundError:
        raise CheckpointCorruptError(
            store.where(marker_path),
            "no commit marker: this step was never committed",
            "It cannot be loaded.",
        ) from None
    except (ValueError, KeyError, TypeError):
        raise CheckpointCorruptError(
            store.where(marker_path), "commit marker is not valid"
        ) from None
    try:
        data = store.read(manifest_path)
    except FileNotFoundError:
        raise CheckpointCorruptError(store.where(manifest_path), "manifest is missing") from None
    if crc32c_of_bytes(data) != want_crc:
        raise CheckpointCorruptError(
            store.where(manifest_path),
            f"manifest crc32c {crc32c_of_bytes(data)} differs from the marker's {want_crc}",
        )
    if signer is not None:
        signer.check(bytes(data), signature, store.where(marker_path))
        if signature is None and signer.active:  # admitted by allow_unsigned: if no signed
            older = (s for s in all_steps(store) if s < step)  # step is older (planted?)
            first = next((s for s in older if _marker_signed(store, s)), None)
            signer.check_unsigned_order(step, first, store.where(marker_path))
    manifest = Manifest.from_bytes(bytes(data), store.where(manifest_path))
    if signer is not None and signature is not None and signer.active:
        plain = [f.path for f in manifest.files if f.digest is None]
        if plain:  # a CRC is no proof against a deliberate change
            raise CheckpointCorruptError(
                store.where(manifest_path), f"signed, but {plain[0]} has no cryptographic digest"
            )
    if manifest.step != want_step or want_step != step:
        raise CheckpointCorruptError(
            store.where(marker_path), f"marker names step {want_step}, folder differs"
        )
    return manifest


def _marker_signed(store: Storage, step: int) -> bool:
    """Whether a step's COMMIT carries a signature (valid or not: a bogus one can only make
    `allow_unsigned` refuse more, never admit a planted step)."""
    try:
        return "signature" in json.loads(store.read(f"{step_name(step)}/{MARKER}", 0, 4096))
    except (OSError, ValueError, TypeError, CheckpointCorruptError):
        return False


def parse_step(dirname: str) -> int | None:
    m = _STEP_RE.match(dirname)
    return int(m.group(1)) if m else None


def all_steps(folder: str | Storage) -> list[int]:
    """Every `step-N` folder, committed or not, ascending."""
    steps = (parse_step(d) for d in as_storage(folder).list(""))
    return sorted(s for s in steps if s is not None)


def marked_steps(folder: str | Storage, fence: Fence | None = None) -> list[int]:
    """Steps whose folder holds a COMMIT that the lease's record counts, valid or not, ascending.

    A crash can never leave a partial COMMIT (it is created atomically), so a step with a
    counted marker was committed once: if its marker or manifest no longer checks out, it is a
    damaged committed step, kept for inspection and reported on load, never silently removed.
    A COMMIT the record rules out is no commit (see the module docstring): a leftover.
    """
    store = as_storage(folder)
    if fence is not None:
        return [s for s in all_steps(store) if _counts(store, s, fence)]
    return _steady(store, lambda f: [s for s in all_steps(store) if _counts(store, s, f)])


def is_marked(folder: str | Storage, step: int, fence: Fence | None = None) -> bool:
    """`step` is one of `marked_steps` (one step, without listing the folder)."""
    store = as_storage(folder)
    return _counts(store, step, read_fence(store) if fence is None else fence)


def is_committed(folder: str | Storage, step: int, fence: Fence | None = None) -> bool:
    try:
        read_committed(folder, step, fence=fence)
        return True
    except CheckpointCorruptError:
        return False


def committed_steps(folder: str | Storage, fence: Fence | None = None) -> list[int]:
    """The single definition of which steps exist: folders with a valid marker that the
    folder's lease records, ascending (the record is read once, before the markers)."""
    store = as_storage(folder)

    def counted(f: Fence) -> list[int]:
        return [s for s in all_steps(store) if f.admits(s) and is_committed(store, s, f)]

    return counted(fence) if fence is not None else _steady(store, counted)


def _steady(store: Storage, count: Callable[[Fence], list[int]], tries: int = 16) -> list[int]:
    """`count(fence)` with a record that did not change while the folder was listed. A reader
    that is not the writer reads the record, then lists: the writer may commit N and retire
    N-k in between, and the listing then holds no step the old record names (review 4). The
    record read again after the listing says whether that happened; then count again. A
    count is never returned unchecked (review 5): a writer that outpaces every listing is a
    retryable error."""
    fence = read_fence(store)
    for _ in range(tries):
        steps = count(fence)
        again = read_fence(store)
        if again.record == fence.record:
            return steps
        fence = again
    raise OSError(
        errno.EAGAIN,
        f"{store.where('')}: the commit record changed during each of {tries} listings (a "
        "writer commits faster than the folder can be listed); try again",
    )


def quarantined(folder: str | Storage) -> list[str]:
    """Damaged committed steps moved aside by `fallback`, e.g. `step-5.1763900000`."""
    return as_storage(folder).list(QUARANTINE)
