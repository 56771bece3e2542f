"""One writer per checkpoint folder.

`fcntl.flock` on `<folder>/.forge_ckpt.lock`: the kernel releases it when the holder dies, so a
crashed job never leaves a stale lock on a local disk and the next job takes over at once. The
file also records who holds it (host, pid, start time) so a refused job can name the holder.
flock is unreliable on some network filesystems (old NFS); there, run one job per folder by
other means.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from .errors import CheckpointLockedError
from .layout import LOCK


class FolderLock:
    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, LOCK)
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise CheckpointLockedError(
                f"checkpoint folder {os.path.dirname(self.path)} is in use by {holder}; "
                "stop that job or use another folder"
            ) from None
        info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
        return f"host {info['host']}, pid {info['pid']}, started {started}"
    except (ValueError, KeyError, TypeError):
        return "another process (holder unknown)"
