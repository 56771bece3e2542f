"""A file written to the memory tier, checksummed as it passes, as every writer does. When its
size is announced (`size_hint`, as a `Checkpointable`'s snapshot does), streams to `copies`
holders start at once and send each part as it is written: the save's encoding overlaps its
transfer. A part the caller keeps alive and unchanged until `close()` (`write_held`: a
snapshot's tensors) is sent from where it lies, without a copy; other parts are copied once.
Whatever those streams did not place (a holder that died, a file longer or shorter than
announced, no size given) is placed at `close()` from one contiguous buffer
(`MemoryStorage.put_copies`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from ..storage.base import Checksums, FileRecord, Writer
from . import transport
from .cluster import current
from .placement import HolderRef, preference
from .transport import Feed, TransportError

if TYPE_CHECKING:
    from .store import MemoryStorage

STREAM_MIN = 4 * 1024**2  # smaller files are sent whole at close (one round trip fewer)


class MemWriter(Writer):
    def __init__(self, store: MemoryStorage, path: str, exclusive: bool = False) -> None:
        """`exclusive`: a holder that has another file of this name refuses this one."""
        self.store, self.path, self.exclusive = store, path, exclusive
        self.buf = bytearray()  # the bytes written, when not streaming
        self.pos = 0  # bytes written
        self.sums = Checksums(store.digest)
        self.feed: Feed | None = None  # the parts written, when streaming
        self.streams: list[tuple[HolderRef, Future]] = []

    def size_hint(self, nbytes: int) -> None:
        if nbytes < STREAM_MIN or self.pos or self.feed is not None:
            return
        self.feed = Feed(nbytes, self.store.digest)
        self.streams = start_streams(self.store, self.path, self.feed)

    def write(self, data: Any) -> None:
        self._write(data, held=False)

    def write_held(self, data: Any) -> None:
        self._write(data, held=True)

    def _write(self, data: Any, held: bool) -> None:
        mv = memoryview(data).cast("B")
        self.sums.update(mv)
        end = self.pos + mv.nbytes
        if self.feed is not None:
            if end <= self.feed.size:
                # numpy copies without the GIL (a bytes() copy holds it): the streams'
                # sendall calls go on meanwhile
                part = mv if held else memoryview(np.frombuffer(mv, dtype=np.uint8).copy())
                self.feed.append(part)
                self.pos = end
                return
            self._stop_streams()  # longer than announced: buffered, placed at close
        self.buf += mv
        self.pos = end

    def _stop_streams(self) -> None:
        """Cut the streams (holders drop what they got) and keep what was written."""
        assert self.feed is not None
        self._end_feed()
        self.buf = self._joined()
        self.feed = None

    def _end_feed(self) -> None:
        """Cancel the feed and wait until no stream still sends from its parts."""
        assert self.feed is not None
        self.feed.cancel()
        for _, fut in self.streams:
            fut.exception()  # wait for it to end
        self.streams = []

    def _joined(self) -> bytearray:
        """The parts streamed so far, as one buffer (only when a copy must be placed again)."""
        out, at = bytearray(self.pos), 0
        for part in self.feed.segments if self.feed is not None else ():
            out[at : at + part.nbytes] = part
            at += part.nbytes
        return out

    def close(self) -> FileRecord:
        record = self.sums.record(self.path)
        placed: list[str] = []
        if self.feed is not None:
            if self.pos == self.feed.size:
                self.feed.finish(transport.record_dict(record, self.exclusive, self.store.token))
                try:
                    placed = end_streams(self.streams)
                except BaseException:  # a holder refused: the other streams may still send
                    self._end_feed()  # from the held parts; none does once this raises
                    self.feed = None
                    raise
                self.streams = []
                # every copy streamed: nothing to place again, no contiguous copy made
                self.buf = self._joined() if len(placed) < self.store.copies else bytearray()
                self.feed = None
            else:
                self._stop_streams()  # shorter than announced
        data, self.buf = memoryview(self.buf), bytearray()
        self.store.put_copies(self.path, data, record, placed, self.exclusive)
        return record

    def abort(self) -> None:
        if self.feed is not None:
            self._end_feed()
            self.feed = None
        self.buf = bytearray()


def start_streams(store: MemoryStorage, path: str, feed: Feed) -> list[tuple[HolderRef, Future]]:
    """A stream to each of the first `copies` holders that have a listener (by preference)."""
    from .calls import _DEAD

    key = store.key(path)
    me = current().node_id()
    out: list[tuple[HolderRef, Future]] = []
    for h in preference(key, store.holders, me):
        if len(out) == store.copies:
            break
        try:
            ep = store.endpoint(h[0])
        except _DEAD:
            continue
        if ep is not None:
            out.append((h, _run(transport.put_feed, ep, key, feed)))
    return out


def end_streams(streams: list[tuple[HolderRef, Future]]) -> list[str]:
    """The node ids whose holder acked; a holder's refusal (budget, checksum) raises."""
    placed = []
    for h, fut in streams:
        try:
            fut.result()
        except TransportError:
            continue  # placed again at close: on it if it lives (through Ray), or elsewhere
        placed.append(h[1])
    return placed


def _run(fn: Any, *args: Any) -> Future:
    """`fn(*args)` in a thread of its own (a stream waits for its writer: never in a pool)."""
    fut: Future = Future()

    def body() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:
            fut.set_exception(e)

    threading.Thread(target=body, name="forge-mem-stream", daemon=True).start()
    return fut
