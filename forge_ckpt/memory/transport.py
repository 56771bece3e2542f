"""The memory tier's data plane: a file's bytes go straight between a writer (or reader) and
a holder over a TCP stream between the two processes, not through Ray's object store. Ray
stays the control plane: it places the holders, says who is alive, and tells where each
holder listens (`Holder.endpoint()`); a holder that cannot be reached directly is used
through Ray as before (`store.py` falls back).

Wire format: every message is a 4-byte big-endian length and a JSON header. A put is the
header, the holder's go-ahead (or its refusal: a file larger than its whole budget), the
`size` bytes, then its answer; a get's answer header is followed by its `n` bytes. Bytes are
received with `recv_into` straight into their final buffer and checksummed as they arrive.
A connection serves one request at a time and is kept in the client's pool for the next.

Every request carries the holder's token (random, handed out by `endpoint()` through Ray):
only a process that can call the holder through Ray can write to it or read from it.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import json
import os
import secrets
import socket
import socketserver
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import CheckpointCorruptError
from ..storage.base import AlreadyExistsError, Checksums, FileRecord, StorageError

CHUNK = 8 * 1024**2  # bytes per recv_into: checksummed while the next ones arrive
CONNECT_TIMEOUT_S = 10.0
IO_TIMEOUT_S = 300.0  # a stalled transfer fails (then Ray decides whether the holder lives)
MAX_HEADER = 1 << 20
_LEN = struct.Struct("!I")
CREATE_ONLY = "create_only"  # in a put's record: refused where another file of the name is kept
FENCE = "fence"  # in a put's record: its writer's token (Holder._admit)


class TransportError(OSError):
    """The direct stream failed (nobody listens, reset, timeout, refused token): the caller
    asks Ray whether the holder lives, then falls back to the object store."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    token: str

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "token": self.token}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Endpoint:
        return cls(str(d["host"]), int(d["port"]), str(d["token"]))


class Files(Protocol):
    """What a holder offers its listener (holder.py)."""

    def room_for(self, key: str, size: int) -> None: ...
    def accept(self, key: str, buf: bytearray, sums: Checksums, record: dict) -> None: ...
    def view(
        self, key: str, start: int, end: int | None, limit: int | None
    ) -> tuple[int | None, memoryview | None]: ...


# ---- framing ------------------------------------------------------------------------------
def send_header(sock: socket.socket, header: dict[str, Any]) -> None:
    raw = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)


def recv_header(sock: socket.socket) -> dict[str, Any] | None:
    """The next header, or None at a clean end of stream."""
    first = sock.recv(_LEN.size, socket.MSG_WAITALL)
    if not first:
        return None
    if len(first) != _LEN.size:
        raise ConnectionError("stream cut inside a header")
    (n,) = _LEN.unpack(first)
    if n > MAX_HEADER:
        raise ConnectionError(f"header of {n} bytes: not a forge_ckpt memory holder stream")
    raw = bytearray(n)
    recv_into(sock, memoryview(raw))
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ConnectionError("malformed header")
    return header


def recv_into(sock: socket.socket, out: memoryview, sums: Checksums | None = None) -> None:
    """Fill `out` from the stream, checksumming each piece as it arrives."""
    got, n = 0, len(out)
    while got < n:
        k = sock.recv_into(out[got : min(n, got + CHUNK)])
        if k == 0:
            raise ConnectionError(f"stream ended after {got} of {n} bytes")
        if sums is not None:
            sums.update(out[got : got + k])
        got += k


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# ---- the holder's side ----------------------------------------------------------------------
class _Handler(socketserver.BaseRequestHandler):
    server: _Listener

    def handle(self) -> None:
        sock: socket.socket = self.request
        _tune(sock)
        self.server.track(sock, True)
        try:
            while (header := recv_header(sock)) is not None:
                if not hmac.compare_digest(str(header.get("token", "")), self.server.token):
                    send_header(sock, {"ok": False, "error": "TransportError",
                                       "message": "wrong token"})  # fmt: skip
                    return
                if not self._serve(sock, header):
                    return
        except (OSError, ValueError):
            return  # the client went away or spoke nonsense: drop the connection
        finally:
            self.server.track(sock, False)

    def _serve(self, sock: socket.socket, h: dict[str, Any]) -> bool:
        """One request; False when the connection must close (a refused put's bytes unread)."""
        files = self.server.files
        if h.get("op") == "get":
            total, view = files.view(h["key"], int(h["start"]), h.get("end"), h.get("limit"))
            n = 0 if view is None else len(view)
            send_header(sock, {"ok": True, "size": total, "n": n, "data": view is not None})
            if view is not None:
                sock.sendall(view)
            return True
        if h.get("op") != "put":
            send_header(sock, {"ok": False, "error": "TransportError", "message": "bad op"})
            return False
        key, size, algo = str(h["key"]), int(h["size"]), h.get("algo")
        try:
            files.room_for(key, size)
        except Exception as e:
            send_header(sock, error_header(e))
            return False
        send_header(sock, {"ok": True})
        buf = bytearray(size)
        sums = Checksums(None if algo is None else str(algo))
        recv_into(sock, memoryview(buf), sums)
        trailer = recv_header(sock)  # the writer's record: known once every byte was written
        if trailer is None:
            return False
        try:
            files.accept(key, buf, sums, dict(trailer["record"]))
        except Exception as e:
            send_header(sock, error_header(e))
            return True
        send_header(sock, {"ok": True})
        return True


class _Listener(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, host: str, files: Files) -> None:
        super().__init__((host, 0), _Handler)
        self.files, self.token = files, secrets.token_hex(16)
        self.open: set[socket.socket] = set()
        self.guard = threading.Lock()

    def track(self, sock: socket.socket, on: bool) -> None:
        with self.guard:
            (self.open.add if on else self.open.discard)(sock)

    def stop(self) -> None:
        """Stop listening and cut every open connection (their clients fall back)."""
        self.shutdown()
        self.server_close()
        with self.guard:
            for sock in self.open:
                _shutdown(sock)


class Server:
    """A holder's listener on its node's address: one thread accepts, one per connection."""

    def __init__(self, host: str, files: Files) -> None:
        self._listener = _Listener(host, files)
        host_, port = self._listener.server_address[:2]
        self.endpoint = Endpoint(str(host_), int(port), self._listener.token)
        threading.Thread(target=self._listener.serve_forever, name="forge-mem-listen",
                         daemon=True).start()  # fmt: skip

    def stop(self) -> None:
        self._listener.stop()


def record_dict(
    record: FileRecord, exclusive: bool, fence: tuple[int, int, int] | None = None
) -> dict[str, Any]:
    """What a holder is sent with a file's bytes: their record, whether to refuse them where
    another file of that name is kept, and the writer's token (`Holder.accept`)."""
    out = {**record.to_dict(), CREATE_ONLY: True} if exclusive else record.to_dict()
    if fence is not None:
        out[FENCE] = list(fence)
    return out


def error_header(e: BaseException) -> dict[str, Any]:
    """A holder's refusal, rebuilt as the same error on the client (`remote_error`)."""
    text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    out: dict[str, Any] = {"ok": False, "error": type(e).__name__, "message": text}
    if isinstance(e, CheckpointCorruptError):
        out.update(path=e.path, problem=e.problem, hint=e.hint)
    return out


def remote_error(h: dict[str, Any]) -> Exception:
    from .holder import MemoryBudgetError, StaleWriteError

    name, msg = h.get("error"), str(h.get("message", ""))
    if name == "MemoryBudgetError":
        return MemoryBudgetError(msg)
    if name == "StaleWriteError":
        return StaleWriteError(msg)
    if name == "CheckpointCorruptError":
        return CheckpointCorruptError(str(h["path"]), str(h["problem"]), h.get("hint"))
    if name == "TransportError":
        return TransportError(msg)
    if name == "AlreadyExistsError":
        return AlreadyExistsError(errno.EEXIST, msg)
    return StorageError(f"memory holder: {name}: {msg}")


# ---- the client's side ----------------------------------------------------------------------
class _Pool:
    """Idle connections per endpoint, for this process (a forked child starts its own)."""

    def __init__(self) -> None:
        self.idle: dict[Endpoint, list[socket.socket]] = {}
        self.lock = threading.Lock()
        self.pid = os.getpid()

    def take(self, ep: Endpoint) -> socket.socket:
        with self.lock:
            if self.pid != os.getpid():
                self.idle, self.pid = {}, os.getpid()
            conns = self.idle.get(ep)
            if conns:
                return conns.pop()
        sock = socket.create_connection((ep.host, ep.port), timeout=CONNECT_TIMEOUT_S)
        sock.settimeout(IO_TIMEOUT_S)
        _tune(sock)
        return sock

    def give(self, ep: Endpoint, sock: socket.socket) -> None:
        with self.lock:
            self.idle.setdefault(ep, []).append(sock)

    def drop(self, ep: Endpoint) -> None:
        with self.lock:
            conns = self.idle.pop(ep, [])
        for sock in conns:
            sock.close()


_POOL = _Pool()


@contextlib.contextmanager
def _connection(ep: Endpoint) -> Iterator[socket.socket]:
    """A connection to `ep`, back to the pool after a clean exchange; any stream failure is a
    TransportError (the connection is closed: its state is unknown)."""
    try:
        sock = _POOL.take(ep)
    except OSError as e:
        raise TransportError(f"connecting to {ep.host}:{ep.port}: {e}") from e
    try:
        yield sock
    except (OSError, ValueError) as e:
        sock.close()
        if isinstance(e, TransportError):
            raise
        raise TransportError(f"stream to {ep.host}:{ep.port}: {type(e).__name__}: {e}") from e
    except BaseException:
        sock.close()
        raise
    else:
        _POOL.give(ep, sock)


def _answer(sock: socket.socket) -> dict[str, Any]:
    h = recv_header(sock)
    if h is None:
        raise ConnectionError("holder closed the stream")
    return h


def put(ep: Endpoint, key: str, data: memoryview, record: dict[str, Any]) -> None:
    """Hand the bytes to the holder; its refusal (budget, checksum) is raised as the same
    error a put through Ray raises."""
    _put(ep, key, len(data), _algo(record), [data], lambda: record)


def put_feed(ep: Endpoint, key: str, feed: Feed) -> None:
    """Stream a file to the holder while it is being written (`Feed`)."""
    _put(ep, key, feed.size, feed.algo, feed.parts(), feed.final, feed)


def _algo(record: dict[str, Any]) -> str | None:
    digest = record.get("digest")
    return None if digest is None else str(digest).split(":", 1)[0]


def _put(
    ep: Endpoint,
    key: str,
    size: int,
    algo: str | None,
    parts: Iterable[memoryview],
    record: Callable[[], dict[str, Any]],
    feed: Feed | None = None,
) -> None:
    try:
        refused = _exchange_put(ep, {"op": "put", "token": ep.token, "key": key, "size": size,
                                     "algo": algo}, parts, record, feed)  # fmt: skip
    except TransportError as e:
        if isinstance(e.__cause__, _Refused):
            raise remote_error(e.__cause__.header) from None
        raise
    if refused is not None:
        raise remote_error(refused)


def _exchange_put(
    ep: Endpoint,
    header: dict[str, Any],
    parts: Iterable[memoryview],
    record: Callable[[], dict[str, Any]],
    feed: Feed | None = None,
) -> dict[str, Any] | None:
    """header, go-ahead, the bytes, the record, the answer; the holder's refusal or None.
    A `feed` cancelled meanwhile shuts the connection down (a send blocked on a stalled
    holder ends at once), and a connection it shut never goes back to the pool."""
    with _connection(ep) as sock:
        if feed is not None:
            feed.watch(sock)
        try:
            send_header(sock, header)
            go = _answer(sock)
            if not go["ok"]:
                raise _Refused(go)  # the bytes are not sent: the connection closes
            for part in parts:
                sock.sendall(part)
            send_header(sock, {"record": record()})
            done = _answer(sock)
        finally:
            if feed is not None and not feed.unwatch(sock):
                raise ConnectionError("the writer gave up the file")
    return None if done["ok"] else done


class Feed:
    """A file of `size` bytes sent by streams as its parts are written (a save's encoding
    overlaps its transfer). Each part is a view the writer keeps alive and unchanged until
    the file is closed or cancelled, so the bytes are sent from where they lie; `cancel()`
    cuts the streams."""

    def __init__(self, size: int, algo: str | None) -> None:
        self.size, self.algo = size, algo
        self.segments: list[memoryview] = []
        self.filled, self.cancelled = 0, False
        self.record: dict[str, Any] | None = None
        self.cond = threading.Condition()
        self._socks: set[socket.socket] = set()  # the streams' connections, while they send

    def watch(self, sock: socket.socket) -> None:
        """A stream sends on `sock`: `cancel()` shuts it down (at once, if already cancelled)."""
        with self.cond:
            if self.cancelled:
                _shutdown(sock)
            else:
                self._socks.add(sock)

    def unwatch(self, sock: socket.socket) -> bool:
        """The stream is done with `sock`; False if `cancel()` shut it down."""
        with self.cond:
            if sock not in self._socks:
                return False
            self._socks.discard(sock)
            return True

    def append(self, part: memoryview) -> None:
        with self.cond:
            self.segments.append(part)
            self.filled += part.nbytes
            self.cond.notify_all()

    def finish(self, record: dict[str, Any]) -> None:
        with self.cond:
            self.record = record
            self.cond.notify_all()

    def cancel(self) -> None:
        with self.cond:
            self.cancelled = True
            for sock in self._socks:  # a sendall blocked on a stalled holder ends now
                _shutdown(sock)
            self._socks.clear()
            self.cond.notify_all()

    def parts(self) -> Iterator[memoryview]:
        i, sent = 0, 0
        while sent < self.size:
            with self.cond:
                while len(self.segments) <= i and not self.cancelled:
                    self.cond.wait()
                if self.cancelled:
                    raise ConnectionError("the writer gave up the file")
                part = self.segments[i]
            yield part
            i, sent = i + 1, sent + part.nbytes

    def final(self) -> dict[str, Any]:
        with self.cond:
            self.cond.wait_for(lambda: self.record is not None or self.cancelled)
            if self.record is None:
                raise ConnectionError("the writer gave up the file")
            return self.record


class _Refused(ConnectionError):
    """The holder refused a put before its bytes."""

    def __init__(self, header: dict[str, Any]) -> None:
        super().__init__(header.get("message"))
        self.header = header


def get(
    ep: Endpoint,
    key: str,
    start: int = 0,
    end: int | None = None,
    limit: int | None = None,
    into: memoryview | None = None,
    sums: Checksums | None = None,
) -> bytearray | int | None:
    """Bytes [start, end) of `key` (into `into` when given: then their count), None if the
    holder has no such file, or the file's size when the range is longer than `limit`."""
    with _connection(ep) as sock:
        send_header(sock, {"op": "get", "token": ep.token, "key": key, "start": start,
                           "end": end, "limit": limit})  # fmt: skip
        h = _answer(sock)
        if not h["ok"]:
            raise remote_error(h)
        if h["size"] is None or not h["data"]:  # no such file, or only its size
            return None if h["size"] is None else int(h["size"])
        n = int(h["n"])
        if into is not None and len(into) != n:
            raise ConnectionError(f"holder sent {n} bytes, {len(into)} were asked for")
        if into is None:
            out = bytearray(n)
            recv_into(sock, memoryview(out), sums)
            return out
        recv_into(sock, into, sums)
    return n


def forget(ep: Endpoint) -> None:
    """Close the idle connections to `ep` (its holder went away or moved)."""
    _POOL.drop(ep)


def _shutdown(sock: socket.socket) -> None:
    """End a connection's sends and receives now (one already closed or reset is fine)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
