"""torch.save's zip CRC32, off in the threads that write forge_ckpt's DCP files.

DCP writes every tensor item with `torch.save`, whose zip writer computes a CRC32 of each
record in software: 0.7 CPU-seconds per GiB on this project's machines, more than the raw
write and fsync of the same bytes, on the save's critical path. forge_ckpt's writer already
checksums every byte (CRC32C, and a digest when signing) as it passes, and every verified load
checks that, so the zip's own CRC adds nothing here. `torch.load`, stock DCP and TorchTitan
load records written without it (torch documents this for `set_crc32_options(False)`).

The setting is torch's `torch.utils.serialization.config.save.compute_crc32`, which recent
torch keeps per thread (a `ContextVar`): it is turned off only inside the writing thread,
for the length of one file, so the job's own `torch.save` calls elsewhere are untouched.
Where torch keeps it process-wide instead, it is left alone. `FORGE_CKPT_ZIP_CRC32=1`
keeps torch's CRC32 in every record. The block must end in the thread it began in (DCP
opens and closes each file's stream in one `with`, in one thread): the setting is restored
in the thread that ends it. Python's `zipfile` refuses records without the CRC (`Bad
CRC-32`); `torch.load` and DCP do not check it.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from contextvars import ContextVar

from torch.utils.serialization import config


def _per_thread() -> bool:
    """Whether torch keeps this setting per thread (read-only look at its config entry)."""
    entry = getattr(config, "_config", {}).get("save.compute_crc32")
    return isinstance(getattr(entry, "user_override", None), ContextVar)


PER_THREAD = _per_thread()


def kept() -> bool:
    """Whether the user asked to keep torch's zip CRC32 (`FORGE_CKPT_ZIP_CRC32=1`)."""
    return os.environ.get("FORGE_CKPT_ZIP_CRC32", "") not in ("", "0")


@contextmanager
def off() -> Generator[None, None, None]:
    """torch.save in this thread writes no zip CRC32 until the block ends."""
    if kept() or not PER_THREAD:
        yield
        return
    before = config.save.compute_crc32
    try:  # set inside the try: an exception raised as it is set still restores it
        config.save.compute_crc32 = False
        yield
    finally:
        config.save.compute_crc32 = before
