"""The memory tier's data plane (`forge_ckpt/memory/transport.py`) between real sockets in
this process, with a file table in place of a holder actor (tests/test_memory_tier.py runs
it between the nodes of a Ray cluster): puts checked against the writer's record as the bytes
arrive, a put streamed while its file is still being written, reads into a given buffer, and
each failure a caller must tell apart: a refusal (the holder's own error) from a broken
stream (a TransportError: the caller asks Ray and falls back)."""

from __future__ import annotations

import os
import threading

import pytest

from forge_ckpt.errors import CheckpointCorruptError
from forge_ckpt.memory import cluster, transport
from forge_ckpt.memory.holder import Holder, MemoryBudgetError
from forge_ckpt.memory.transport import Endpoint, Feed, Server, TransportError
from forge_ckpt.storage.base import AlreadyExistsError, Checksums, FileRecord, check_record


class Table:
    """What a holder offers its listener, minus Ray: a dict and a budget."""

    def __init__(self, budget: int) -> None:
        self.budget, self.files = budget, {}

    def room_for(self, key: str, size: int) -> None:
        if size > self.budget:
            raise MemoryBudgetError(f"{key} ({size} bytes) does not fit")

    def accept(self, key: str, buf: bytearray, sums: Checksums, record: dict) -> None:
        check_record(key, sums.size, f"{sums.crc:08x}", FileRecord.from_dict(record))
        self.files[key] = buf

    def view(self, key, start, end, limit):
        data = self.files.get(key)
        if data is None:
            return None, None
        v = memoryview(data)[start:end]
        return len(data), (None if limit is not None and len(v) > limit else v)


def record(data: bytes, path: str = "f") -> dict:
    c = Checksums()
    c.update(data)
    return c.record(path).to_dict()


@pytest.fixture
def holder():
    table = Table(budget=1 << 26)
    server = Server("127.0.0.1", table)
    yield table, server.endpoint
    server.stop()
    transport._POOL.drop(server.endpoint)  # this process's idle connections to it


def test_put_get_and_ranges(holder):
    table, ep = holder
    data = os.urandom(3 * transport.CHUNK + 123)
    transport.put(ep, "k", memoryview(data), record(data))
    assert table.files["k"] == data
    assert transport.get(ep, "k") == data
    sums = Checksums()
    assert transport.get(ep, "k", 5, 1005, sums=sums) == data[5:1005] and sums.size == 1000
    out = bytearray(100)
    assert transport.get(ep, "k", 10, 110, into=memoryview(out)) == 100 and out == data[10:110]
    assert transport.get(ep, "k", limit=10) == len(data)  # too long: its size only
    assert transport.get(ep, "missing") is None


def test_refusals_are_the_holders_errors_and_keep_nothing(holder):
    table, ep = holder
    data = os.urandom(1000)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        transport.put(ep, "bad", memoryview(data), record(data[:-1] + bytes([data[-1] ^ 1])))
    with pytest.raises(MemoryBudgetError, match="does not fit"):
        transport.put(ep, "big", memoryview(bytearray(table.budget + 1)), record(b""))
    assert table.files == {}
    transport.put(ep, "ok", memoryview(data), record(data))  # the pool's next connection
    assert table.files["ok"] == data


def test_a_put_streams_while_the_file_is_written(holder):
    """The holder has the first part before the writer wrote the rest; the record comes last."""
    table, ep = holder
    data = os.urandom(2 * transport.CHUNK)
    feed = Feed(len(data), None)
    done: list = []
    t = threading.Thread(target=lambda: done.append(transport.put_feed(ep, "s", feed)))
    t.start()
    half = len(data) // 2
    feed.append(memoryview(data)[:half])
    feed.append(memoryview(data)[half:])
    feed.finish(record(data))
    t.join()
    assert done == [None] and table.files["s"] == data

    feed = Feed(10, None)  # a writer that gives up: the holder keeps nothing
    cut: list = []
    t = threading.Thread(target=lambda: cut.append(pytest.raises(TransportError,
                         transport.put_feed, ep, "gone", feed)))  # fmt: skip
    t.start()
    feed.cancel()
    t.join()
    assert cut and "gone" not in table.files


def _unread(conn) -> int:
    """Bytes received on `conn` that nobody read yet."""
    import fcntl
    import struct
    import termios

    return struct.unpack("i", fcntl.ioctl(conn, termios.FIONREAD, b"\0\0\0\0"))[0]


def test_cancelling_a_feed_ends_a_send_blocked_on_a_stalled_holder():
    """A writer that gives up (abort) waits for its streams, which may send from the
    caller's tensors: a holder that stopped reading must not hold it there until the I/O
    timeout. The cancel shuts the connection down; the stream ends with a TransportError."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list = []

    def stalled_holder() -> None:
        conn, _ = listener.accept()
        accepted.append(conn)
        transport.recv_header(conn)
        transport.send_header(conn, {"ok": True})  # go ahead, then never read a byte

    peer = threading.Thread(target=stalled_holder, daemon=True)
    peer.start()
    ep = Endpoint("127.0.0.1", listener.getsockname()[1], "t" * 32)
    data = memoryview(bytearray(256 * 1024**2))  # far more than the sockets' buffers hold
    feed = Feed(len(data), None)
    feed.append(data)
    ended: list = []
    stream = threading.Thread(target=lambda: ended.append(
        pytest.raises(TransportError, transport.put_feed, ep, "stalled", feed)))  # fmt: skip
    stream.start()
    peer.join(timeout=60)
    # the stream is sending, and blocked: bytes wait unread on the holder's side
    while not (accepted and _unread(accepted[0]) > 0):
        stream.join(timeout=0.01)
        assert stream.is_alive(), "the stream ended before it was stalled"
    feed.cancel()
    stream.join(timeout=transport.IO_TIMEOUT_S / 2)  # a bound for a hang, never a speed
    assert not stream.is_alive() and ended, "the stream still waits on the stalled holder"
    for conn in accepted:
        conn.close()
    listener.close()
    transport._POOL.drop(ep)


def test_broken_streams_are_transport_errors(holder):
    table, ep = holder
    with pytest.raises(TransportError, match="wrong token"):
        transport.get(Endpoint(ep.host, ep.port, "0" * 32), "k")
    free = Server("127.0.0.1", table)
    gone = free.endpoint
    free.stop()
    with pytest.raises(TransportError, match="connecting"):
        transport.get(gone, "k")


class OneNode(cluster.RayCluster):
    def node_id(self) -> str:
        return "node0"


@pytest.fixture
def real_holder():
    """A real `Holder` (its file table, its refusals) behind a listener in this process."""
    old = cluster.install(OneNode())
    try:
        h = Holder("run", "fp", budget=1 << 26, keep=4, listen=False)
        server = Server("127.0.0.1", h)
        yield h, server.endpoint
        server.stop()
        transport._POOL.drop(server.endpoint)
    finally:
        cluster.install(old)


@pytest.mark.parametrize("via", ["stream", "call"])
def test_a_create_only_put_never_replaces_another_file(real_holder, via):
    """Review 20, claim 2: a stale job shares its successor's holders, and a late write of
    its trainer rank (same name as the successor's file) replaced the successor's committed
    memory file: its verified load failed, an unverified one returned the stale weights.
    A step's files are put create-only: another file of that name is refused (and kept as
    it was); the same bytes again are a retry's, accepted."""
    h, ep = real_holder
    mine, stale = os.urandom(5000), os.urandom(5000)
    key = "run/step-2/trainer/.metadata"

    def put(data: bytes, exclusive: bool = True) -> None:
        rec = transport.record_dict(FileRecord.from_dict(record(data)), exclusive)
        if via == "stream":
            transport.put(ep, key, memoryview(data), rec)
        else:
            h.put(key, [data], rec)

    put(mine)
    with pytest.raises(AlreadyExistsError, match="another writer"):
        put(stale)
    assert h.files[key] == mine
    put(mine)  # a retry of the successor's own put (its reply lost)
    put(stale, exclusive=False)  # what a non-exclusive write (a scratch file) may do
    assert h.files[key] == stale


@pytest.mark.parametrize("via", ["stream", "call"])
def test_bytes_changed_in_flight_are_refused_with_the_savers_advice(real_holder, via):
    """Review 36: a threaded actor that changed its state while a sync save sent it got the
    holder's refusal with the advice for a damaged stored file ("run forge-ckpt verify ...
    load an older step"). The bytes never reached storage: the error names the writer's
    record and says what the actor did and that the last committed step is unchanged."""
    h, ep = real_holder
    sent = bytearray(os.urandom(5000))
    rec = record(bytes(sent))
    sent[100] ^= 1  # the actor's state changed after its checksum
    with pytest.raises(CheckpointCorruptError) as e:
        if via == "stream":
            transport.put(ep, "run/step-3/actors/a.msgpack", memoryview(sent), rec)
        else:
            h.put("run/step-3/actors/a.msgpack", [bytes(sent)], rec)
    text = str(e.value)
    assert "the writer's record says" in text and "changed while it was being saved" in text
    assert "forge-ckpt verify" not in text and "newest committed step is unchanged" in text
    assert h.files == {}
