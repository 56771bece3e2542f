"""The raw transport under the memory tier's data plane, for `python -m benchmarks.tiers`:
plain TCP `sendall` / `recv_into` of the same bytes between actors on different nodes of the
same cluster, no forge_ckpt, no checksum, no Ray in the data path. Measured in the same trial
as the tier, it is the ceiling the tier's save and load are compared with:

- send: node_a streams the bytes to the head and to node_b at once (a save's two copies),
  each received into a fresh buffer; done when both acked;
- recv1: node_a receives the bytes from the head's heap in one stream;
- recv2: node_a receives one half from the head and one from node_b at once, into one buffer
  (as the tier spreads a large read over the holders of the file).
"""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
from typing import Any

import numpy as np
import ray

from .. import contention

CHUNK = 8 * 1024**2


def _recv_into(sock: socket.socket, out: memoryview) -> None:
    got = 0
    while got < len(out):
        k = sock.recv_into(out[got : got + CHUNK])
        if k == 0:
            raise ConnectionError(f"stream ended after {got} of {len(out)} bytes")
        got += k


class RawPeer:
    """One node's end of a raw transfer (an actor: `spawn(RawPeer, node)`)."""

    def __init__(self) -> None:
        self.data: np.ndarray | None = None
        self.srv: socket.socket | None = None

    def listen(self) -> tuple[str, int]:
        """A listener on this node's address; (host, port)."""
        if self.srv is None:
            self.srv = socket.create_server((ray.util.get_node_ip_address(), 0))
        host, port = self.srv.getsockname()[:2]
        return str(host), int(port)

    def hold(self, nbytes: int) -> None:
        """`nbytes` of non-zero bytes in this process's heap, every page touched."""
        self.data = np.full(nbytes, 0x5A, dtype=np.uint8)

    def receive(self, nbytes: int) -> float:
        """Accept one stream of `nbytes` into a fresh buffer, then ack; seconds it took."""
        assert self.srv is not None
        conn, _ = self.srv.accept()
        with conn:
            t0 = time.perf_counter()
            buf = bytearray(nbytes)
            _recv_into(conn, memoryview(buf))
            conn.sendall(b"k")
            return time.perf_counter() - t0

    def serve(self, start: int, stop: int) -> None:
        """Accept one connection and send bytes [start, stop) of the held data."""
        assert self.srv is not None and self.data is not None
        conn, _ = self.srv.accept()
        with conn:
            conn.sendall(self.data.data[start:stop])

    def send(self, addrs: list[tuple[str, int]]) -> float:
        """Stream the held bytes to every address at once; seconds until all acked."""
        assert self.data is not None
        view = self.data.data

        def one(addr: tuple[str, int]) -> None:
            with socket.create_connection(addr) as s:
                s.sendall(view)
                s.recv(1)

        return _threads(one, addrs)

    def fetch(self, parts: list[tuple[tuple[str, int], int, int]]) -> float:
        """Receive each (address, start, stop) part into its place in one fresh buffer, all
        at once; seconds."""
        t0 = time.perf_counter()
        buf = memoryview(bytearray(max(stop for _, _, stop in parts)))

        def one(part: tuple[tuple[str, int], int, int]) -> None:
            addr, start, stop = part
            with socket.create_connection(addr) as s:
                _recv_into(s, buf[start:stop])

        _threads(one, parts)
        return time.perf_counter() - t0  # with the buffer's allocation, as a read does

    def release(self) -> None:
        self.data = None
        gc.collect()


def _threads(fn: Any, items: list[Any]) -> float:
    """Run `fn` on every item in its own thread; seconds until all ended (errors raised)."""
    errors: list[BaseException] = []

    def run(item: Any) -> None:
        try:
            fn(item)
        except BaseException as e:
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return seconds


async def measure(peers: dict[str, Any], nbytes: int) -> dict[str, Any]:
    """send (node_a -> head + node_b), recv1 (head -> node_a), recv2 (both -> node_a)."""
    a, h, b = peers["node_a"], peers["head"], peers["node_b"]
    listening = await asyncio.gather(h.listen.remote(), b.listen.remote())
    addr = {"head": tuple(listening[0]), "node_b": tuple(listening[1])}
    await a.hold.remote(nbytes)
    cpu0 = contention.machine_cpu_s()
    got = await asyncio.gather(a.send.remote(list(addr.values())),
                               h.receive.remote(nbytes), b.receive.remote(nbytes))  # fmt: skip
    send_cpu = contention.machine_cpu_s() - cpu0
    await a.release.remote()
    await asyncio.gather(h.hold.remote(nbytes), b.hold.remote(nbytes))
    _, recv1 = await asyncio.gather(h.serve.remote(0, nbytes),
                                    a.fetch.remote([(addr["head"], 0, nbytes)]))  # fmt: skip
    half = nbytes // 2
    parts = [(addr["head"], 0, half), (addr["node_b"], half, nbytes)]
    cpu0 = contention.machine_cpu_s()
    *_, recv2 = await asyncio.gather(h.serve.remote(0, half), b.serve.remote(half, nbytes),
                                     a.fetch.remote(parts))  # fmt: skip
    recv2_cpu = contention.machine_cpu_s() - cpu0
    await asyncio.gather(*(p.release.remote() for p in peers.values()))
    return {"send_s": got[0], "recv1_s": recv1, "recv2_s": recv2, "bytes": nbytes,
            "send_cpu_s": send_cpu, "recv2_cpu_s": recv2_cpu}  # fmt: skip
