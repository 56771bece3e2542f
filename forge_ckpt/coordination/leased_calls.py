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
        # Held only for a few lines, never across I/O; re-entrant: a dropped call's
        # finalizer (_Call.__del__) may run wherever its last reference goes.
        self._state = threading.RLock()
        self._busy = 0
        self._close_requested = False
        self._closed = False

    @property
    def closing(self) -> bool:
        """close() was asked for (the lease may still be held by a call that runs)."""
        return self._closed or self._close_requested

    @property
    def busy(self) -> int:
        """How many calls run now, or were submitted and may still start."""
        return self._busy

    def check_open(self) -> None:
        if self.closing:
            raise CheckpointError("this CheckpointCoordinator is closed")

    def submit(self, fn: Callable[..., Any], *args: Any) -> _Call:
        """`fn(*args)` as a call to hand to a thread, counted as running from now: a call
        queued behind busy executor workers when its event loop was closed (nothing
        cancelled) runs later, and the next loop must wait for it as for one that runs
        (review 15, claim 1). One dropped unrun (its queued work cancelled) stops counting
        then."""
        with self._state:
            self.check_open()
            self._busy += 1
        return _Call(self, fn, args)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` under the lease, now, in this thread."""
        return self.submit(fn, *args)()

    def _under_lease(self, fn: Callable[..., Any], args: tuple) -> Any:
        """Storage calls find the lease (lock.CURRENT), and a delete request checks first
        that it is still held, renewed just now (lock.FRESH_S)."""
        if self._close_requested:  # asked for since this call was submitted: refused (the
            raise CheckpointError("this CheckpointCoordinator is closed")  # release waits)
        token = CURRENT_LEASE.set(self._lease)
        fence = BEFORE_DELETE.set(self._fresh_lease)
        try:
            return fn(*args)
        finally:
            BEFORE_DELETE.reset(fence)
            CURRENT_LEASE.reset(token)

    def _end(self) -> None:
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


class _Call:
    """One submitted call: counted until it ends, or until it is dropped without running
    (`drop`: its caller was cancelled before a thread took it; or the object is freed, as a
    queued executor item that was cancelled is discarded)."""

    __slots__ = ("_calls", "_fn", "_args", "_phase")

    def __init__(self, calls: LeasedCalls, fn: Callable[..., Any], args: tuple) -> None:
        self._calls, self._fn, self._args, self._phase = calls, fn, args, "queued"

    def __call__(self) -> Any:
        with self._calls._state:
            if self._phase != "queued":  # dropped: its caller is gone, nothing waits for it
                raise CheckpointError("a storage call dropped before it ran")
            self._phase = "running"
        try:
            return self._calls._under_lease(self._fn, self._args)
        finally:
            self._calls._end()

    def drop(self) -> None:
        """Stop counting a call that no thread has started (and never will); a running one
        ends its count itself. (review 17: the cancelled task of a queued call kept this
        object alive through its exception's traceback, and the count with it.)"""
        with self._calls._state:
            dropped, self._phase = self._phase == "queued", "dropped"
        if dropped:
            self._calls._end()

    def __del__(self) -> None:
        if self._phase == "queued":
            self.drop()
