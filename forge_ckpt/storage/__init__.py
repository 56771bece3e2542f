"""Where checkpoint bytes live: one small interface; local, S3 and in-memory (`mem://`)."""

from __future__ import annotations

from typing import Any

from .base import (
    AlreadyExistsError,
    FileRecord,
    PreconditionFailedError,
    Storage,
    StorageError,
    StorageSpec,
    Writer,
    crc32c_of_bytes,
    fault,
    join,
)

__all__ = [
    "AlreadyExistsError",
    "FileRecord",
    "PreconditionFailedError",
    "Storage",
    "StorageError",
    "StorageSpec",
    "Writer",
    "crc32c_of_bytes",
    "fault",
    "join",
    "normalize_url",
    "open_storage",
]

_open: dict[StorageSpec, Storage] = {}  # recently used, bounded (one per step folder)
_OPEN_MAX = 64
# Further URL schemes ("name://" -> how to open one): forge_ckpt.sim adds its simulated stores.
SCHEMES: dict[str, Any] = {}


def normalize_url(url: str) -> str:
    """An absolute local path, or the URL as given: resolved once, in the driver, so that
    every actor (with its own working directory, maybe on another node) sees the same place."""
    import os

    if "://" in url and not url.startswith("file://"):
        if not url.startswith(("s3://", "mem://", *SCHEMES)):
            raise ValueError(
                f"{url!r}: supported folders are local paths, file://, s3:// and mem:// "
                "(the memory tier's holders, see docs/tiers.md)"
            )
        return url.rstrip("/")
    return os.path.abspath(url.removeprefix("file://"))


def open_storage(where: str | StorageSpec, options: dict[str, Any] | None = None) -> Storage:
    """The storage for a folder URL (or a spec received from the driver); cached per process
    so actors reuse clients and thread pools across saves."""
    spec = (
        where
        if isinstance(where, StorageSpec)
        else StorageSpec(normalize_url(where), dict(options or {}))
    )
    cached = _open.get(spec)
    if cached is not None:
        return cached
    scheme = spec.url.split("://", 1)[0] + "://"
    if scheme in SCHEMES:
        store: Storage = SCHEMES[scheme](spec)
    elif spec.url.startswith("s3://"):
        from .s3 import S3Storage

        store = S3Storage(spec)
    elif spec.url.startswith("mem://"):
        from ..memory.store import MemoryStorage

        store = MemoryStorage(spec)
    else:
        from .local import LocalStorage

        store = LocalStorage(spec)
    if len(_open) >= _OPEN_MAX:
        _open.pop(next(iter(_open)))
    _open[spec] = store
    return store
