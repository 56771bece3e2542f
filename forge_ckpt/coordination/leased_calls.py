"""A coordinator's storage calls under its lease, and a close that never cuts one in half.

Every call that writes, moves or removes files in the folder runs through `LeasedCalls.run`:
it is refused once `close()` was asked for, and one that is running when `close()` is asked
for keeps the lease until it ends (the last one to end releases it). So nothing is ever
written to the folder after the release, and `close()` itself never blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointError
from ..steps.lock import CURRENT as CURRENT_LEASE
from ..steps.lock import Lease
from ..storage.base import BEFORE_DELETE


class LeasedCalls:
    """The calls of one coordinator on its folder; `release` runs once, after the last."""

    def __init__(self, lease: Lease, release: Callable[[], None]) -> None:
        self._lease, self._release = lease, release
        self._state = threading.Lock()  # held only for a few lines, never across I/O
        self._busy = 0
        self._close_requested = False
        self._closed = False

    @property
    def closing(self) -> bool:
        """close() was asked for (the lease may still be held by a call that runs)."""
        return self._closed or self._close_requested

    @property
    def busy(self) -> int:
        """How many calls run now."""
        return self._busy

    def check_open(self) -> None:
        if self.closing:
            raise CheckpointError("this CheckpointCoordinator is closed")

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` under the lease: storage calls find it (lock.CURRENT), and a delete
        request checks first that it is still held, renewed just now (lock.FRESH_S)."""
        with self._state:
            self.check_open()
            self._busy += 1
        token = CURRENT_LEASE.set(self._lease)
        fence = BEFORE_DELETE.set(self._fresh_lease)
        try:
            return fn(*args)
        finally:
            BEFORE_DELETE.reset(fence)
            CURRENT_LEASE.reset(token)
            with self._state:
                self._busy -= 1
                release = self._close_requested and self._busy == 0 and not self._closed
                self._closed = self._closed or release
            if release:
                self._release()

    def close(self) -> None:
        """Release now if no call runs, else when the last one ends; a second close is a no-op."""
        with self._state:
            if self._closed:
                return
            self._close_requested = True
            release = self._busy == 0
            self._closed = release
        if release:
            self._release()

    def _fresh_lease(self) -> None:
        self._lease.check(fresh=True)
