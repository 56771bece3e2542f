"""A coordinator's blocking storage calls, and what an event loop that ends under them leaves.

Each call runs off the event loop, in a thread, under the coordinator's lease (`LeasedCalls`
counts it from its submission until it ends). A thread cannot be stopped: a call whose caller
was cancelled runs to its end, and the next save or load waits for it (`running`).

An event loop can also end under its calls without anyone awaiting them: a runner that closes
it without cancelling its tasks, or without joining its executor. Such a call may still run,
or may not even have started (queued behind busy workers), and what it writes (a COMMIT, say)
must be there before the next loop's load decides whether it landed (reviews 9, 12, 14, 15).
So the next save or load waits, bounded by `save_timeout_s`, until no call runs. Work still
under way in another event loop that is open (left idle) can end only there: it is refused,
with what to do, rather than waited for forever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import CheckpointError
from .leased_calls import LeasedCalls

POLL_S = 0.02  # how often a look waits for the calls an earlier loop left running


class StorageCalls:
    """The storage calls of one coordinator and the event loops they ran in."""

    def __init__(
        self,
        leased: LeasedCalls,
        to_thread: Callable[..., Awaitable[Any]],
        bound_s: Callable[[], float],
    ) -> None:
        """`bound_s`: how long a look waits for an earlier loop's calls (read at each look)."""
        self.leased = leased
        self.running: set[asyncio.Future] = set()  # what the next save or load waits for
        self.orphans = False  # calls of a loop that ended may still run
        self._to_thread = to_thread
        self._bound_s = bound_s
        self._last_loop: Any = None  # the event loop of the last look

    async def io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` off the event loop, under the lease; the next save or load waits for
        it if its caller is cancelled meanwhile."""
        call = asyncio.ensure_future(self.background(fn, *args))
        self.running.add(call)
        call.add_done_callback(self._ended)
        return await asyncio.shield(call)

    async def background(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` off the event loop, under the lease, counted from the step that hands
        it to a thread: a call whose task never started (its loop closed first) is never
        counted (review 16: it kept the count up, and every later look waited it out). A
        persist's calls come here directly: not in `running`, since the persist runs beside
        the saves (a load settles it first), and a save must not wait out its calls (each
        up to the S3 call bound)."""
        call = self.leased.submit(fn, *args)
        try:
            return await self._to_thread(call)
        except asyncio.CancelledError:  # (a thread may have it already: then it runs on)
            call.drop()
            raise

    def _ended(self, call: asyncio.Future) -> None:
        """A finished call leaves `running`; its error, if nobody awaits it any more, is
        retrieved so that asyncio does not report it. One cancelled by its loop's end may
        still run in its thread (review 9)."""
        self.running.discard(call)
        if call.cancelled():
            self.orphans = True
        else:
            call.exception()

    def look(self, elsewhere: list[asyncio.Future]) -> None:
        """Before a save or load looks: work of another loop that is still open is refused
        (at every look: that loop may have started it since this loop's last one, review
        17); in a loop other than the last one, a call running now is an earlier loop's (a
        persist's COMMIT whose task that loop cancelled: review 14, claim 1)."""
        refuse_open_elsewhere([*self.running, *elsewhere])
        loop = asyncio.get_running_loop()
        if self._last_loop is not loop:
            self.orphans = self.orphans or (self._last_loop is not None and self.leased.busy > 0)
            self._last_loop = loop

    def suspect_running(self) -> None:
        """Every call the caller waits for has ended: one still running was cut off from its
        caller, and is waited for like an earlier loop's."""
        self.orphans = self.orphans or self.leased.busy > 0

    async def await_orphans(self) -> None:
        """Until no storage call of this coordinator runs, if an earlier loop may have left
        one. Looked at every POLL_S on the loop's clock, not waited for in a thread: in the
        simulation the calls run on the loop's own thread, and a blocked wait would stop them."""
        if not self.orphans:
            return
        loop = asyncio.get_running_loop()
        bound = self._bound_s()
        deadline = loop.time() + bound
        while self.leased.busy and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        if self.leased.busy:
            raise CheckpointError(
                f"a storage call of an event loop that was shut down still runs after "
                f"{bound:g} s (save_timeout_s); what it leaves cannot be read yet: "
                "retry once it ends"
            )
        self.orphans = False


def refuse_open_elsewhere(futures: list[asyncio.Future]) -> None:
    """Work of this coordinator under way in another event loop that is still open (left
    idle, not closed) can end only in that loop: waiting for it here would wait forever
    (review 15, claim 3). A closed loop's is dropped instead (`reap_closed`)."""
    here = asyncio.get_running_loop()
    for fut in futures:
        if fut.get_loop() is not here and not fut.done():
            refuse_loop(fut.get_loop())


def refuse_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Refuse to go on beside work under way in `loop`, if it is another loop, still open."""
    if loop is not asyncio.get_running_loop() and not loop.is_closed():
        raise CheckpointError(
            f"this CheckpointCoordinator has work under way in another event loop that is "
            f"still open ({loop!r}); run that loop until it ends, or close it, before using "
            "the coordinator from this one (asyncio.run() does both)"
        )
