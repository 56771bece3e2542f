"""One writer per checkpoint folder: a lease, because flock means nothing between machines,
is unreliable on NFS and does not exist on object stores.

The lease is one object, `<folder>/.forge_ckpt.lease`, holding the holder (host, pid, start
time), an expiry and a generation number. It is taken with a create-if-absent, or, once the
previous holder's lease expired (or it released it, or it was a process on this host that is
gone), with a replace-if-unchanged: of two jobs racing for it exactly one wins. The holder
renews it from a thread every `ttl/3` seconds with the same conditional replace, so a holder
that was taken over notices on its next renewal. The generation goes into every manifest it
commits (a fencing token), and the commit renews the lease right before writing the marker: a
holder that stalled past its expiry and was taken over cannot commit over its successor.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from .errors import CheckpointLockedError
from .layout import LEASE
from .storage import AlreadyExistsError, PreconditionFailedError, Storage

log = logging.getLogger("forge_ckpt")
_HELD: set[str] = set()  # owners of the leases this process holds right now


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of a process (tells a live pid from a reused one)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class Lease:
    def __init__(
        self,
        store: Storage,
        ttl_s: float = 60.0,
        *,
        clock: Callable[[], float] = time.time,
        renew_in_background: bool = True,
        identity: dict[str, Any] | None = None,
    ) -> None:
        """`clock`: wall-clock seconds for every expiry decision; `renew_in_background=False`
        starts no renewal thread (the caller renews, as the simulation does); `identity`
        overrides this machine's host/pid in the lease (the simulation's processes)."""
        self.store = store
        self.ttl_s = ttl_s
        self.generation = 0
        self._clock = clock
        self._background = renew_in_background
        self._identity = identity
        self._owner = uuid.uuid4().hex
        self._started = clock()
        self._tag: str | None = None
        self._lost: str | None = None
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._tag is not None and self._lost is None

    def _content(self, generation: int, expires: float, released: bool = False) -> bytes:
        pid = os.getpid()
        me = {"host": socket.gethostname(), "pid": pid, "pid_start": _proc_start(pid)}
        return json.dumps(
            {
                "owner": self._owner,
                **(self._identity or me),
                "started": self._started,
                "renewed": self._clock(),
                "expires": expires,
                "generation": generation,
                "released": released,
            }
        ).encode()

    def acquire(self) -> None:
        """Take the lease or raise CheckpointLockedError naming its live holder."""
        for _ in range(3):
            current = self.store.read_tagged(LEASE)
            try:
                if current is None:
                    self._tag = self.store.create(LEASE, self._content(1, self._expiry()))
                    self.generation = 1
                else:
                    holder = _parse(current[0])
                    if _is_live(holder, self._clock()):
                        raise CheckpointLockedError(
                            f"checkpoint folder {self.store.url} is in use by {_describe(holder)}; "
                            "stop that job or use another folder (if it is dead, its lease "
                            "expires at the time shown)"
                        )
                    gen = int(holder.get("generation", 0)) + 1
                    self._tag = self.store.replace(
                        LEASE, self._content(gen, self._expiry()), current[1]
                    )
                    self.generation = gen
            except (AlreadyExistsError, PreconditionFailedError):
                continue  # another job moved first: look again
            _HELD.add(self._owner)
            self._start_renewals()
            return
        raise CheckpointLockedError(
            f"checkpoint folder {self.store.url}: lost every race for the lease"
        )

    def _expiry(self) -> float:
        return self._clock() + self.ttl_s

    def _start_renewals(self) -> None:
        self._lost = None
        self._stop.clear()
        if not self._background:
            return
        self._thread = threading.Thread(
            target=self._renew_loop, daemon=True, name="forge-ckpt-lease"
        )
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.renew()
            except CheckpointLockedError as e:
                log.error("%s", e)
                return
            except OSError as e:  # storage unreachable: keep trying until the lease expires
                log.warning("could not renew the lease on %s: %s", self.store.url, e)

    def renew(self) -> None:
        """Extend the lease (conditional on nobody having taken it over); the commit calls
        this right before its marker, so a stale holder fails here instead of committing."""
        with self._mutex:
            if self._lost is not None:
                raise CheckpointLockedError(self._lost)
            if self._tag is None:
                raise CheckpointLockedError(f"{self.store.url}: the lease is not held")
            try:
                self._tag = self.store.replace(
                    LEASE, self._content(self.generation, self._expiry()), self._tag
                )
            except PreconditionFailedError:
                current = self.store.read_tagged(LEASE)
                who = _describe(_parse(current[0])) if current else "nobody (it was deleted)"
                self._lost = (
                    f"lost the lease on {self.store.url} (generation {self.generation}): it was "
                    f"taken over by {who}; this job must stop writing the folder"
                )
                raise CheckpointLockedError(self._lost) from None

    def release(self) -> None:
        """Mark the lease released (the next job takes it at once); keeps the generation.
        If that write fails (a read-only disk), this process still knows the lease is free."""
        _HELD.discard(self._owner)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        with self._mutex:
            if self._tag is not None and self._lost is None:
                try:
                    data = self._content(self.generation, self._clock(), released=True)
                    self.store.replace(LEASE, data, self._tag)
                except (PreconditionFailedError, OSError) as e:
                    log.warning("could not release the lease on %s: %s", self.store.url, e)
            self._tag = None


def _parse(data: bytes) -> dict[str, Any]:
    try:
        d = json.loads(data)
        return d if isinstance(d, dict) else {}
    except ValueError:
        return {}  # unreadable: treated as expired


def _is_live(holder: dict[str, Any], now: float) -> bool:
    if not holder or holder.get("released") or float(holder.get("expires", 0)) < now:
        return False
    if holder.get("host") == socket.gethostname() and holder.get("pid_start") is not None:
        pid = int(holder["pid"])
        if pid == os.getpid() and holder.get("pid_start") == _proc_start(pid):
            return holder.get("owner") in _HELD  # this process knows which of its leases live
        # A holder on this machine whose process is gone (or whose pid was reused) is dead
        # now, not at its expiry: a restarted job takes over at once.
        return _proc_start(pid) == holder["pid_start"]
    return True


def _describe(holder: dict[str, Any]) -> str:
    try:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
        expires = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["expires"]))
        return (
            f"host {holder['host']}, pid {holder['pid']}, started {started} (lease "
            f"generation {holder['generation']}, expires {expires})"
        )
    except (KeyError, TypeError, ValueError):
        return "another process (holder unknown)"
