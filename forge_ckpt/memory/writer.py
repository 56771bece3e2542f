"""A file written to the memory tier. Buffered and checksummed as it passes, as every writer
does; when its size is announced (`size_hint`, as a `Checkpointable`'s snapshot does), the
buffer is allocated at its final size and streams to `copies` holders start at once, each
sending the bytes as they are written: the save's encoding overlaps its transfer. Whatever
those streams did not place (a holder that died, a file longer than announced, no size
given) is placed at `close()` from the buffer (`MemoryStorage.put_copies`).
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
        self.buf = bytearray()
        self.pos = 0  # bytes written (into `buf` when streaming)
        self.sums = Checksums(store.digest)
        self.feed: Feed | None = None
        self.arr: np.ndarray | None = None  # `buf` as an array while streaming
        self.streams: list[tuple[HolderRef, Future]] = []

    def size_hint(self, nbytes: int) -> None:
        if nbytes < STREAM_MIN or self.pos or self.feed is not None:
            return
        self.buf = bytearray(nbytes)
        self.arr = np.frombuffer(self.buf, dtype=np.uint8)
        self.feed = Feed(self.buf, self.store.digest)
        self.streams = start_streams(self.store, self.path, self.feed)

    def write(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        self.sums.update(mv)
        end = self.pos + mv.nbytes
        if self.feed is not None and self.arr is not None:
            if end <= len(self.buf):
                # numpy copies without the GIL (a bytearray slice holds it): the streams'
                # sendall calls go on meanwhile (measured: 3-4x faster together)
                self.arr[self.pos : end] = np.frombuffer(mv, dtype=np.uint8)
                self.pos = end
                self.feed.advance(end)
                return
            self._stop_streams()  # longer than announced: buffered, placed at close
        self.buf += mv
        self.pos = end

    def _stop_streams(self) -> None:
        """Cut the streams (holders drop what they got) and keep what was written."""
        assert self.feed is not None
        self.feed.cancel()
        for _, fut in self.streams:
            fut.exception()  # wait for it to end
        self.feed.view.release()
        self.feed, self.streams, self.arr = None, [], None
        try:
            del self.buf[self.pos :]
        except BufferError:  # a stream's slice of the buffer still alive
            self.buf = bytearray(memoryview(self.buf)[: self.pos])

    def close(self) -> FileRecord:
        record = self.sums.record(self.path)
        placed: list[str] = []
        if self.feed is not None:
            if self.pos == len(self.buf):
                self.feed.finish(transport.record_dict(record, self.exclusive, self.store.token))
                placed = end_streams(self.streams)
            else:
                self._stop_streams()
        data, self.buf = memoryview(self.buf)[: self.pos], bytearray()
        self.store.put_copies(self.path, data, record, placed, self.exclusive)
        return record

    def abort(self) -> None:
        if self.feed is not None:
            self.feed.cancel()
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
