"""Where the coordinator's blocking calls run and what time it is.

A job uses threads and the OS clock. The deterministic simulation (forge_ckpt.sim) hands the
same coordinator its own: blocking calls run in lockstep with a virtual clock, and the lease is
renewed by the simulation instead of a thread, so one seed replays one schedule exactly.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Runtime:
    to_thread: Callable[..., Awaitable[Any]] = asyncio.to_thread
    wall: Callable[[], float] = time.time  # wall-clock seconds (leases, manifests)
    lease_thread: bool = True  # renew the lease from a thread (False: the caller renews)
    identity: dict[str, Any] | None = None  # the lease holder's machine identity, if not ours
    # The locks held across storage calls (the lease's, the commit's): the simulation's wait
    # in virtual time, letting the holder run, where a real lock would block its one thread.
    lock: Callable[[], Any] = threading.Lock


DEFAULT = Runtime()
