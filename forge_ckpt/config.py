"""`CheckpointConfig`: every knob of the coordinator, loadable from a YAML file in `configs/`."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from .steps.commit import RetentionPolicy
from .steps.signing import Signer
from .storage import StorageSpec, normalize_url

DEPRECATED_ASYNC = (
    "async_mode='async' is deprecated and now means 'deferred' (save() returns once the "
    "snapshot calls are submitted; a failure surfaces from wait() or the next save()); "
    "set async_mode='deferred' (or checkpoint.async_mode=deferred) to silence this"
)


@dataclass
class CheckpointConfig:
    """How and where a job checkpoints.

    folder: where `step-N/` folders go: a local path (made absolute here, in the driver, so
        every actor sees the same place), `file://...` or `s3://bucket/prefix`. One job per
        folder: it holds a lease on it.
    storage_options: for `s3://` folders: endpoint_url, region_name, aws_access_key_id,
        aws_secret_access_key, profile_name, part_size_mb, max_concurrency, max_attempts,
        connect_timeout_s, read_timeout_s (see docs/storage.md). Unset keys come from the AWS
        environment and config files. Never printed.
    lease_ttl_s: how long the folder's lease lasts without renewal; a dead job on another
        machine blocks the folder at most this long (on this machine: not at all).
    max_clock_skew_s: how far the clocks of two machines that share the folder may be apart;
        another machine's lease counts as live until its expiry plus this much (the fence
        relies on it, docs/protocol.md "Fault model"), so a dead job blocks that much longer.
    keep_last / keep_every: retention; `keep_last=None` keeps everything.
    async_mode: "sync" blocks `save()` until the commit; "deferred" (the stall-free cut)
        returns once every snapshot call is submitted: actors snapshot before any later call
        of the driver runs, and a trainer rank copies its state while the loop goes on, its
        next optimizer step waiting only if that copy is unfinished; the write and commit run
        in the background (`wait()` flushes and raises their failure). "async" is deprecated:
        it waited for every snapshot (0.29 of a sync save where deferred blocks 0.003) and now
        means "deferred", with a FutureWarning.
    save_timeout_s / load_timeout_s: a component that takes longer is treated as failed.
    abort_timeout_s: after a failed save, how long each unit may take to stop its write.
    digest: a cryptographic digest of every file in the manifest, computed while writing and
        checked while reading ("blake3" or "sha256"; default: none unless signing is on, then
        "blake3"). CRC32C is always recorded.
    signing_key / verify_keys: sign each step's manifest with HMAC-SHA256 (the signature goes
        into COMMIT); accept steps signed by any of these keys (rotation). Default: the
        environment's FORGE_CKPT_SIGNING_KEY / FORGE_CKPT_VERIFY_KEYS. Never written anywhere.
    allow_unsigned: with a key configured, still load steps that were saved unsigned, but only
        steps older than every signed step in the folder (a planted unsigned step never wins).
    verify_on_load: check every file's crc32c before anything is loaded (DCP's `.metadata` is
        a pickle: never open one that does not match the manifest). A step whose files carry
        digests (every signed step) is verified whatever this says.
    fallback: on a corrupt newest step, load the newest intact committed one instead.
    fingerprint: identifies the run (a hash of its config); a folder from another run is
        refused on load (and the memory tier retires holders of another run).
    memory_every: 1 turns on the replicated memory tier (docs/tiers.md): every save goes to
        holder actors on other nodes; 0 (default) saves only to `folder`.
    durable_every: with the memory tier, every Nth save is also persisted to `folder`, in the
        background, from the holders' copies.
    memory_copies: copies of each file, each on another node than its writer's: losing any
        `memory_copies - 1` nodes leaves a whole memory step.
    memory_budget_bytes / memory_keep: each holder's byte budget, and how many newest memory
        steps it keeps when a new file needs room; a file that does not fit fails the save.
    memory_namespace: the Ray namespace of the (detached, named) holder actors.
    on_event: called with a `forge_ckpt.coordination.events.CheckpointEvent` after every save, persist and
        load (docs/api.md); in code only, never from YAML. Also logged to `forge_ckpt.coordination.events`.
    """

    folder: str
    keep_last: int | None = 3
    keep_every: int | None = None
    async_mode: Literal["sync", "async", "deferred"] = "sync"
    save_timeout_s: float = 600.0
    load_timeout_s: float = 600.0
    verify_on_load: bool = True
    fallback: bool = False
    fingerprint: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)
    lease_ttl_s: float = 60.0
    max_clock_skew_s: float = 5.0
    abort_timeout_s: float = 60.0
    digest: Literal["blake3", "sha256"] | None = None
    signing_key: str | bytes | None = field(default=None, repr=False)
    verify_keys: list[str | bytes] = field(default_factory=list, repr=False)
    allow_unsigned: bool = False
    memory_every: int = 0
    durable_every: int = 1
    memory_copies: int = 2
    memory_budget_bytes: int = 8 * 1024**3
    memory_keep: int = 2
    memory_namespace: str = "forge_ckpt"
    on_event: Callable[[Any], Any] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.on_event is not None and not callable(self.on_event):
            raise ValueError(
                f"on_event must be a callable (given in code, not in YAML), got {self.on_event!r}"
            )
        self.folder = normalize_url(str(self.folder))
        if self.folder.startswith("mem://"):
            raise ValueError(
                f"folder={self.folder!r}: the folder is the durable tier; the memory tier is "
                "turned on with memory_every=1 (docs/tiers.md)"
            )
        if self.async_mode not in ("sync", "async", "deferred"):
            raise ValueError(f"async_mode must be 'sync' or 'deferred', got {self.async_mode!r}")
        if self.async_mode == "async":
            warnings.warn(DEPRECATED_ASYNC, FutureWarning, stacklevel=3)
            self.async_mode = "deferred"
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {self.keep_last}")
        if self.keep_every is not None and self.keep_every < 1:
            raise ValueError(f"keep_every must be >= 1 or None, got {self.keep_every}")
        if (
            min(self.save_timeout_s, self.load_timeout_s, self.lease_ttl_s, self.abort_timeout_s)
            <= 0
        ):
            raise ValueError("timeouts must be positive")
        if self.max_clock_skew_s < 0:
            raise ValueError(
                f"max_clock_skew_s must be >= 0 (seconds two machines' clocks may differ), "
                f"got {self.max_clock_skew_s}"
            )
        if self.memory_every not in (0, 1):
            raise ValueError(
                f"memory_every must be 0 (off) or 1 (every save), got {self.memory_every}"
            )
        if min(self.durable_every, self.memory_copies, self.memory_keep) < 1:
            raise ValueError("durable_every, memory_copies and memory_keep must be >= 1")
        if self.memory_budget_bytes <= 0:
            raise ValueError("memory_budget_bytes must be positive")

    @property
    def signer(self) -> Signer:
        return Signer.from_config(self.signing_key, self.verify_keys, self.allow_unsigned)

    @property
    def storage(self) -> StorageSpec:
        """What actors and ranks open: the folder, its options and the digest they compute."""
        digest = self.digest or ("blake3" if self.signer.signing_key is not None else None)
        options = dict(self.storage_options)
        if digest is not None:
            options["digest"] = digest
        return StorageSpec(self.folder, options)

    @property
    def retention(self) -> RetentionPolicy:
        return RetentionPolicy(keep_last=self.keep_last, keep_every=self.keep_every)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CheckpointConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown checkpoint config keys: {unknown}; known: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_file(cls, path: str, **overrides: Any) -> CheckpointConfig:
        """Load from YAML; the file may hold the keys at top level or under `checkpoint:`."""
        with open(path) as f:
            d = yaml.safe_load(f) or {}
        d = d.get("checkpoint", d) or {}  # `checkpoint:` with nothing under it: defaults
        return cls.from_dict({**d, **overrides})
