"""Deterministic execution for the simulation: virtual time, and blocking code run in lockstep.

The coordinator is asyncio code that hands blocking storage calls to threads. To run it
unchanged and reproducibly, the simulation gives it

- an event loop whose clock is virtual: when nothing is ready, the loop jumps to the next
  timer instead of waiting (`asyncio.sleep`, `wait_for` and every timeout run at once, in
  virtual seconds);
- a `run_io` that runs the blocking function as a greenlet, one at a time: each storage
  operation is a gate where it stops and hands control back; the loop resumes it at the
  virtual time the operation completes. So other tasks, other
  processes and other jobs interleave between any two storage operations, and every choice
  (latency, fault, order) comes from one seeded random generator.

Nothing here knows about checkpoints: `World` (world.py) decides what each gate does.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import selectors
import weakref
from collections.abc import Callable
from typing import Any

import greenlet  # type: ignore[import-untyped]

EPOCH = 1_800_000_000.0  # the virtual wall clock starts here (leases store wall-clock times)


class Deadlock(RuntimeError):
    """Every task waits and no timer is set: a call that can never return."""


class Crash(BaseException):
    """Raised inside a process that the simulation killed (like SIGKILL: no cleanup runs
    storage operations, since every later gate of the dead process raises this again)."""


class _Selector(selectors.BaseSelector):
    """No real I/O: `select` advances the virtual clock by the loop's timeout."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._map: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, id(fileobj), events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._map.pop(fileobj)

    def select(self, timeout: float | None = None) -> list:
        if timeout is None:
            raise Deadlock("every task waits and no timer is set")
        self._clock.now += max(timeout, 0.0)
        return []

    def close(self) -> None:
        self._map.clear()

    def get_map(self) -> Any:
        return self._map


class Clock:
    """Virtual seconds since the start of the simulation."""

    def __init__(self) -> None:
        self.now = 0.0

    def wall(self) -> float:
        """The virtual `time.time()`."""
        return EPOCH + self.now


class _Numbered:
    """Hashed by its creation number in the loop, not by its address: a set of tasks or
    futures (asyncio.wait's `pending`, which the coordinator cancels one by one) iterates in
    the same order in every process, whatever that process ran before (a seed run by a
    worker after other seeds replays the same alone)."""

    _n: int

    def __hash__(self) -> int:
        return self._n


class _Task(_Numbered, asyncio.Task):
    def __init__(self, coro: Any, *, loop: SimLoop, context: Any = None) -> None:
        self._n = next(loop.numbers)  # first: the task is hashed as it registers itself
        super().__init__(coro, loop=loop, context=context)  # type: ignore[call-arg]


class _Future(_Numbered, asyncio.Future):
    def __init__(self, *, loop: SimLoop) -> None:
        self._n = next(loop.numbers)
        super().__init__(loop=loop)


class _Refs(dict):
    """The set of weak references of an OrderedWeakSet, in insertion order."""

    def add(self, ref: Any) -> None:
        self[ref] = None

    def discard(self, ref: Any) -> None:
        self.pop(ref, None)

    def remove(self, ref: Any) -> None:
        del self[ref]


class OrderedWeakSet(weakref.WeakSet):
    """A WeakSet that iterates in insertion order (a WeakSet's order follows the addresses of
    its items, so it depends on what the process ran before): for lock._LEASES."""

    def __init__(self) -> None:
        super().__init__()
        self.data = _Refs()


class SimLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: Clock) -> None:
        super().__init__(_Selector(clock))
        self.clock = clock
        self.stepped: list[asyncio.Future] = []  # resolved when a SimThread runs (poll())
        self.numbers = itertools.count()
        self.set_task_factory(_make_task)

    def time(self) -> float:
        return self.clock.now

    def idle_until(self, delay: float) -> bool:
        """If nothing would run before `delay` virtual seconds from now, move the clock there
        as the loop would (`when - now` added to `now`, the same float) and say so.

        A SimThread's pause is most of the simulation's cost (a timer, a turn of the loop and
        two greenlet switches per storage operation), and most pauses have nothing to let run:
        no callback ready, no poller waiting for a step, no timer due before or with (within
        the clock's resolution) the wake-up. Skipping those turns runs the same schedule:
        the same code in the same order at the same virtual times (the traces are equal).
        This reads asyncio's own loop state (`_ready`, `_scheduled`): a subclass's business."""
        if self._ready or self.stepped or self._stopping:  # type: ignore[attr-defined]
            return False
        now = self.clock.now
        when = now + delay
        timers = self._scheduled  # type: ignore[attr-defined]
        if timers and timers[0]._when < when + self._clock_resolution:  # type: ignore[attr-defined]
            return False
        self.clock.now = now + max(0.0, when - now)
        return True

    def create_future(self) -> asyncio.Future:
        return _Future(loop=self)

    def wake_pollers(self) -> None:
        """A SimThread ran: what a poll() waits on may have changed."""
        waiters, self.stepped = self.stepped, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


def _make_task(loop: Any, coro: Any, context: Any = None) -> asyncio.Task:
    return _Task(coro, loop=loop, context=context)


Gate = Callable[["SimThread", str], float]  # decides an operation's latency (and may raise)


class _Done:
    """What a worker greenlet hands back when its call ended (its value or its exception)."""

    __slots__ = ("ok", "value")

    def __init__(self, ok: bool, value: Any) -> None:
        self.ok, self.value = ok, value


def _work(fn: Callable[..., Any], args: tuple) -> None:
    """A worker greenlet's life: run a call, hand back how it ended, wait for the next one.
    Reused, a greenlet keeps the frame stack it allocated (a new greenlet maps a fresh one:
    a system call and page faults per simulated blocking call)."""
    while True:
        try:  # in a context of its own, as a new greenlet's call ran (review 14, claim 4)
            done = _Done(True, contextvars.Context().run(fn, *args))
        except greenlet.GreenletExit:  # collected while parked: end, as a plain greenlet would
            raise
        except BaseException as e:  # handed to the awaiting task
            done = _Done(False, e)
        fn = args = None  # type: ignore[assignment]
        parent = greenlet.getcurrent().parent
        assert parent is not None
        fn, args = parent.switch(done)


_IDLE: list[Any] = []  # worker greenlets whose call ended, for the next SimThread
_MAX_IDLE = 64


class SimThread:
    """A blocking call run as a greenlet of the loop's thread: it runs until its next gate
    (or its end) each time the loop steps it, so only one piece of code ever runs at once."""

    _by_greenlet: dict[Any, SimThread] = {}

    def __init__(self, proc: Any, fn: Callable[..., Any], args: tuple, fut: asyncio.Future):
        self.proc, self._fut = proc, fut
        self._loop = fut.get_loop()
        self._call: tuple[Callable[..., Any], tuple] | None = (fn, args)
        self._g = _IDLE.pop() if _IDLE else greenlet.greenlet(_work)
        self.done = False
        self.in_op = False  # inside one storage operation (its inner calls are not gates)

    @classmethod
    def current(cls) -> SimThread | None:
        return cls._by_greenlet.get(greenlet.getcurrent())

    def step(self) -> None:
        """Run until the next gate or the end (called from the loop's greenlet)."""
        g = self._g
        g.parent = greenlet.getcurrent()
        SimThread._by_greenlet[g] = self
        call, self._call = self._call, None
        try:
            result = g.switch(*call) if call is not None else g.switch()
        except BaseException as e:  # the worker itself ended (GreenletExit thrown into it)
            self._finish(False, e)
            return
        finally:
            if isinstance(self._loop, SimLoop):
                self._loop.wake_pollers()
        if isinstance(result, _Done):
            if len(_IDLE) < _MAX_IDLE:
                _IDLE.append(g)
            self._finish(result.ok, result.value)

    def _finish(self, ok: bool, value: Any) -> None:
        self.done = True
        SimThread._by_greenlet.pop(self._g, None)
        if self._fut.done():
            return
        if ok:
            self._fut.set_result(value)
        else:
            self._fut.set_exception(value)

    def pause(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        """Called by the worker itself at a gate: stop here until `delay` virtual seconds
        from now (the operation's latency), letting everything else run meanwhile."""
        if isinstance(loop, SimLoop) and loop.idle_until(delay):
            return  # nothing else would have run meanwhile: the clock moved, go on
        loop.call_later(delay, self.step)
        parent = self._g.parent
        assert parent is not None
        parent.switch()

    def wait_until(
        self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future, timeout: float | None
    ) -> bool:
        """Called by the worker itself: stop here until `fut` is done or `timeout` virtual
        seconds passed (a blocking wait on a remote call); whether it is done."""
        if fut.done():
            return True
        woken = False

        def wake(*_: Any) -> None:
            nonlocal woken
            if not woken:
                woken = True
                self.step()

        fut.add_done_callback(wake)
        timer = None if timeout is None else loop.call_later(timeout, wake)
        parent = self._g.parent
        assert parent is not None
        parent.switch()
        if timer is not None:
            timer.cancel()
        fut.remove_done_callback(wake)
        return fut.done()


class SimLock:
    """A lock for code that runs as SimThreads (Runtime.lock): a contended acquire waits in
    virtual time, so that the holder, parked at a gate, runs on; a real lock would block the
    one OS thread every SimThread shares, and the schedule would hang."""

    def __init__(self) -> None:
        self._held = False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        while self._held:
            me = SimThread.current()
            if not blocking or me is None:  # the loop itself cannot wait: it would hang
                if blocking:
                    raise RuntimeError("a SimLock is contended outside a SimThread")
                return False
            me.pause(asyncio.get_running_loop(), 0.0001)
        self._held = True
        return True

    def release(self) -> None:
        self._held = False

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


class SimQueueLock(SimLock):
    """A SimLock whose waiters sleep until the release hands it on (in arrival order),
    instead of looking again every 0.1 ms: a holder parked for a minute (a memory holder's
    call answered after its timeout) would otherwise cost 600,000 looks. The memory tier's
    schedules use it; the others keep SimLock, and with it their traces."""

    def __init__(self) -> None:
        super().__init__()
        self._waiters: list[asyncio.Future] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = SimThread.current()
        if not self._held or not blocking or me is None:
            return super().acquire(blocking, timeout)
        loop = asyncio.get_running_loop()
        while self._held:
            fut = loop.create_future()
            self._waiters.append(fut)
            me.wait_until(loop, fut, None)
        self._held = True
        return True

    def release(self) -> None:
        self._held = False
        while self._waiters:
            fut = self._waiters.pop(0)
            if not fut.done():
                fut.set_result(None)
                return


async def poll(cond: Callable[[], Any], every: float) -> None:
    """`while cond(): await asyncio.sleep(every)` to the virtual tick, without running the loop
    once per tick (a wait behind a delayed operation was tens of thousands of ticks): `cond`
    reads state that only code run by a SimThread changes, so it is constant between two
    SimThread steps; it is read again at the first tick after each step, the tick the
    polling would have read it at (ticks are counted from the start as the sleeps count)."""
    loop = asyncio.get_running_loop()
    assert isinstance(loop, SimLoop)
    tick = loop.time()
    while cond():
        fut = loop.create_future()
        loop.stepped.append(fut)
        await fut  # something ran: the next tick may see it
        now = loop.time()
        tick += every
        while tick <= now:  # the ticks that saw nothing new
            tick += every
        wake = loop.create_future()
        loop.call_at(tick, _resolve, wake)
        await wake


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


PROC: contextvars.ContextVar[Any] = contextvars.ContextVar("forge_ckpt_sim_proc")


async def run_io(fn: Callable[..., Any], *args: Any) -> Any:
    """`asyncio.to_thread` for the simulation (see the module docstring), in the calling
    task's simulated process."""
    fut = asyncio.get_running_loop().create_future()
    SimThread(PROC.get(None), fn, args, fut).step()
    return await fut
