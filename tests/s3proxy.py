"""A fault-injecting HTTP proxy in front of the local S3 server, for throttling and outage tests.

One request per connection: the proxy reads the request head, replaces any Connection header by
`Connection: close`, forwards head and body to the server untouched otherwise (the Host header
too: the SigV4 signature covers it, and the client signed for the proxy's host:port), and pipes
the response back until the server closes. Faults:

- `fail_next(n, status, code)`: the next n requests get an S3 XML error instead, after their
  body was read and discarded (Content-Length or chunked; none when the client waits for
  `100 Continue`, as S3 answers too); `fail_matching` does the same for matching requests;
- `down()` / `up()`: an outage; new connections are refused and open ones are dropped;
- `drop_reply(pattern, method, n)`: the next n matching requests reach the server (they are
  applied) and their reply is thrown away: the client sees the connection closed, as when a
  reply is lost on the network, and retries;
- `cut_reply(pattern, method, after, n)`: the next n matching requests get only the first
  `after` bytes of their reply (head included), then the connection closes: a body cut off
  mid-transfer;
- `hang(pattern, method)`: a black hole; matching requests are read and never answered until
  the client gives up (or `clear()` / `close()`).

Requests match on their method and a regular expression searched in the request target
(`/bucket/key?query`). `log` lists every request as "METHOD target".
"""

from __future__ import annotations

import collections
import http
import re
import socket
import threading
import time
from types import TracebackType
from urllib.parse import urlsplit

from apps.seaweed import free_ports

MAX_HEAD = 64 * 1024
IO_TIMEOUT = 120.0
_HOP_HEADERS = {"connection", "keep-alive", "proxy-connection"}


class _Rule:
    """A fault for the requests that match: `action` ("fail", "drop_reply", "cut" or "hang")
    for the next `left` of them (None: all); `failure` is the (status, code, message) of
    "fail"; `after` the reply bytes "cut" lets through."""

    def __init__(
        self,
        action: str,
        pattern: str,
        method: str | None,
        left: int | None,
        failure: tuple[int, str, str] | None = None,
        after: int = 0,
    ) -> None:
        self.action, self.pattern, self.method = action, re.compile(pattern), method
        self.left, self.failure, self.after = left, failure, after

    def take(self, method: str, target: str) -> bool:
        if self.left == 0 or (self.method is not None and self.method != method):
            return False
        if not self.pattern.search(target):
            return False
        if self.left is not None:
            self.left -= 1
        return True


class _Reader:
    """Buffered reads from a socket: the request head, then (to discard it) the body."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise EOFError
        self.buf += data

    def head(self) -> bytes:
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            if len(self.buf) > MAX_HEAD:
                raise EOFError
            self._fill()
        head = bytes(self.buf[: end + 4])
        del self.buf[: end + 4]
        return head

    def line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self.buf[:end])
        del self.buf[: end + 2]
        return line

    def skip(self, n: int) -> None:
        while n > 0:
            if not self.buf:
                self._fill()
            take = min(n, len(self.buf))
            del self.buf[:take]
            n -= take

    def discard_body(self, headers: dict[str, str]) -> None:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while (size := int(self.line().split(b";")[0].strip(), 16)) > 0:
                self.skip(size + 2)
            while self.line():  # trailers up to the empty line
                pass
        else:
            self.skip(int(headers.get("content-length", "0") or 0))


def _parse(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    fields = [tuple(part.strip() for part in ln.split(":", 1)) for ln in lines[1:] if ":" in ln]
    return lines[0], [(k, v) for k, v in fields]


def _error_response(method: str, path: str, status: int, code: str, message: str) -> bytes:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<Resource>{path}</Resource><RequestId>s3proxy</RequestId></Error>"
    ).encode()
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    head = (
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nx-amz-request-id: s3proxy\r\nConnection: close\r\n\r\n"
    ).encode()
    return head if method == "HEAD" else head + body


def _pump(src: socket.socket, dst: socket.socket, limit: int | None = None) -> None:
    """Copy until `src` closes (or `limit` bytes have passed)."""
    sent = 0
    try:
        while (limit is None or sent < limit) and (data := src.recv(65536)):
            if limit is not None:
                data = data[: limit - sent]
            dst.sendall(data)
            sent += len(data)
    except OSError:
        pass


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class FaultProxy:
    """Runs in a daemon thread of the test process; `endpoint` is what clients connect to."""

    def __init__(self, upstream: str) -> None:
        url = urlsplit(upstream)
        self._upstream = (url.hostname or "127.0.0.1", url.port or 80)
        self.port = free_ports(1, grpc_too=False)[0]  # fixed: up() binds it again
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.requests = 0  # HTTP requests received, failed ones included
        self.failed = 0  # of which answered by fail_next
        self.dropped = 0  # applied by the server, reply thrown away (drop_reply)
        self.hung = 0  # never answered (hang)
        self.log: list[str] = []  # "METHOD target" of every request, in order
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._counted = threading.Condition(self._lock)  # notified when a counter moves
        self._failures: collections.deque[tuple[int, str, str]] = collections.deque()
        self._socks: set[socket.socket] = set()
        self._hanging: set[socket.socket] = set()
        self._want_up, self._closing = True, False
        self._listener: socket.socket | None = self._bind()
        self._acked = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="s3proxy", daemon=True)
        self._thread.start()

    # -- controls ------------------------------------------------------------------------------

    def fail_next(
        self,
        n: int,
        status: int = 503,
        code: str = "SlowDown",
        message: str = "Please reduce your request rate.",
    ) -> None:
        """The next `n` requests get `status` with an S3 error body of `code`."""
        with self._lock:
            self._failures.extend([(status, code, message)] * n)

    def fail_matching(
        self, pattern: str, method: str | None, n: int, status: int, code: str, message: str = ""
    ) -> None:
        """The next `n` requests matching `method` and `pattern` get `status` / `code`."""
        with self._lock:
            self._rules.append(_Rule("fail", pattern, method, n, (status, code, message or code)))

    def drop_reply(self, pattern: str, method: str | None = "PUT", n: int = 1) -> None:
        """The next `n` requests matching `method` and `pattern` are applied by the server and
        their reply is lost: the client sees the connection closed without an answer."""
        with self._lock:
            self._rules.append(_Rule("drop_reply", pattern, method, n))

    def cut_reply(self, pattern: str, method: str | None, after: int, n: int = 1) -> None:
        """The next `n` matching requests get the first `after` bytes of their reply, then
        the connection closes (a body cut off mid-transfer)."""
        with self._lock:
            self._rules.append(_Rule("cut", pattern, method, n, after=after))

    def hang(self, pattern: str = "", method: str | None = None) -> None:
        """Black hole: matching requests are read and never answered, until `clear()`."""
        with self._lock:
            self._rules.append(_Rule("hang", pattern, method, None))

    def clear(self) -> None:
        """Forget every drop_reply / hang rule and end the requests hanging now."""
        with self._lock:
            self._rules.clear()
            hanging = list(self._hanging)
        for sock in hanging:
            _shut(sock)

    def wait_count(self, counter: str, n: int, timeout: float = 60.0) -> None:
        """Wait until `counter` ("requests", "failed", "dropped", "hung") reaches `n`: the
        proxy's threads may count a request after the client already gave up on it."""
        with self._counted:
            if not self._counted.wait_for(lambda: getattr(self, counter) >= n, timeout):
                raise TimeoutError(f"s3proxy: {counter} is {getattr(self, counter)}, not {n}")

    def down(self) -> None:
        """Outage: returns once new connections are refused and open ones are dropped."""
        self._set_state(False)
        with self._lock:
            socks = list(self._socks)
        for sock in socks:
            _shut(sock)

    def up(self) -> None:
        """End of the outage: accept connections again (same port)."""
        self._set_state(True)

    def close(self) -> None:
        """Stop the proxy and drop every connection."""
        if self._closing:
            return
        self._closing = True
        self.down()
        self._thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- machinery -----------------------------------------------------------------------------

    def _set_state(self, up: bool) -> None:
        with self._lock:
            self._want_up = up
            self._acked.clear()
        if not self._acked.wait(timeout=10) and not self._closing:
            raise RuntimeError("s3proxy: the accept thread did not acknowledge")

    def _bind(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(128)
        sock.settimeout(0.05)
        return sock

    def _accept_loop(self) -> None:
        """Owns the listening socket (closing it from another thread could race an accept)."""
        while True:
            with self._lock:
                want_up = self._want_up and not self._closing
            if want_up != (self._listener is not None):
                if self._listener is not None:
                    self._listener.close()
                    self._listener = None
                else:
                    self._listener = self._bind()
            self._acked.set()
            if self._closing:
                return
            if self._listener is None:
                time.sleep(0.02)
                continue
            try:
                conn, _ = self._listener.accept()
            except OSError:  # timeout
                continue
            if self._track(conn):
                threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _track(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._want_up and not self._closing:
                self._socks.add(sock)
                return True
        sock.close()
        return False

    def _handle(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        pump: threading.Thread | None = None
        try:
            client.settimeout(IO_TIMEOUT)
            reader = _Reader(client)
            request_line, headers = _parse(reader.head())
            method, target = (request_line.split(" ") + ["", ""])[:2]
            with self._lock:
                self.requests += 1
                self.log.append(f"{method} {target}")
                failure = self._failures.popleft() if self._failures else None
                rule = (
                    None
                    if failure
                    else next((r for r in self._rules if r.take(method, target)), None)
                )
                if rule is not None and rule.failure is not None:
                    failure, rule = rule.failure, None
                self.failed += failure is not None
            if failure is not None:
                self._fail(
                    client, reader, request_line, dict((k.lower(), v) for k, v in headers), failure
                )
                return
            if rule is not None and rule.action == "hang":
                self._hang(client)
                return
            upstream = socket.create_connection(self._upstream, timeout=10)
            upstream.settimeout(IO_TIMEOUT)
            if not self._track(upstream):
                return
            kept = [f"{k}: {v}" for k, v in headers if k.lower() not in _HOP_HEADERS]
            head = "\r\n".join([request_line, *kept, "Connection: close", "", ""]).encode("latin-1")
            upstream.sendall(head + bytes(reader.buf))
            pump = threading.Thread(target=_pump, args=(client, upstream), daemon=True)
            pump.start()  # the body (and nothing after it: the response closes the connection)
            if rule is None or rule.action == "cut":
                _pump(upstream, client, None if rule is None else rule.after)
                return
            while upstream.recv(65536):  # the server applied it; its reply goes nowhere
                pass
            with self._lock:
                self.dropped += 1
                self._counted.notify_all()
        except (OSError, EOFError, ValueError):
            pass
        finally:
            self._finish(client, upstream, pump)

    def _hang(self, client: socket.socket) -> None:
        """Read and discard until the client gives up (or clear() / down() shut it)."""
        with self._lock:
            self.hung += 1
            self._hanging.add(client)
            self._counted.notify_all()
        try:
            while client.recv(65536):
                pass
        finally:
            with self._lock:
                self._hanging.discard(client)

    def _fail(
        self,
        client: socket.socket,
        reader: _Reader,
        request_line: str,
        headers: dict[str, str],
        failure: tuple[int, str, str],
    ) -> None:
        method, path = (request_line.split(" ") + ["", ""])[:2]
        if headers.get("expect", "").lower() != "100-continue":
            reader.discard_body(headers)
        client.sendall(_error_response(method, path, *failure))

    def _finish(
        self, client: socket.socket, upstream: socket.socket | None, pump: threading.Thread | None
    ) -> None:
        socks = [s for s in (client, upstream) if s is not None]
        for sock in socks:
            _shut(sock)  # wakes the other pump before anything is closed under it
        if pump is not None:
            pump.join(timeout=IO_TIMEOUT)
        with self._lock:
            self._socks.difference_update(socks)
        for sock in socks:
            sock.close()
