"""Raw-disk baselines and page-cache control.

The baselines do what a checkpoint writer at disk speed would do and nothing more: large
buffers written sequentially into one file, then one fsync (the same durability forge_ckpt
gives: every file fsynced before the commit); and a sequential read of a file that is not in
the page cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import numpy as np

MiB = 1 << 20
GiB = 1 << 30
CHUNK = 64 * MiB  # the write/read buffer of the baselines (forge_ckpt's storage uses the same)
DD_BLOCK = 16 * MiB

_BUFFER: np.ndarray | None = None


def _buffer() -> memoryview:
    """64 MiB of non-zero bytes (ext4 does not compress, but keep it honest anyway)."""
    global _BUFFER
    if _BUFFER is None:
        _BUFFER = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8)
    return memoryview(_BUFFER)


def settle() -> None:
    """Flush every dirty page before a timed write, so that it does not pay for the last one."""
    os.sync()


def python_write(path: str, nbytes: int) -> float:
    """Write `nbytes` with os.write in 64 MiB buffers, fsync, close; returns seconds."""
    return python_write_cpu(path, nbytes)[0]


def python_write_cpu(path: str, nbytes: int) -> tuple[float, float]:
    """`python_write`, also returning the CPU seconds (this process, all threads) it took."""
    buf = _buffer()
    settle()
    cpu = time.process_time()
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            view = buf[: min(left, CHUNK)]
            while len(view):
                n = os.write(fd, view)
                view = view[n:]
                left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start, time.process_time() - cpu


def python_write_files(folder: str, files: int, nbytes: int) -> float:
    """`files` files of nbytes/files bytes each, written and fsynced by as many threads at once
    (the file system's cost of many small durable files, without any process or RPC)."""
    from concurrent.futures import ThreadPoolExecutor

    os.makedirs(folder, exist_ok=True)
    each = nbytes // files
    buf = _buffer()

    def one(i: int) -> None:
        fd = os.open(os.path.join(folder, f"{i}.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = each
            while left > 0:
                left -= os.write(fd, buf[: min(left, CHUNK)])
            os.fsync(fd)
        finally:
            os.close(fd)

    settle()
    with ThreadPoolExecutor(files) as pool:
        start = time.perf_counter()
        list(pool.map(one, range(files)))
        return time.perf_counter() - start


def dd_write(path: str, nbytes: int) -> tuple[float, int] | None:
    """`dd if=/dev/zero bs=16M conv=fsync` (the reference everyone knows); None without dd."""
    dd = shutil.which("dd")
    if dd is None:
        return None
    count = max(1, -(-nbytes // DD_BLOCK))
    settle()
    start = time.perf_counter()
    subprocess.run(
        [dd, "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "conv=fsync"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - start, count * DD_BLOCK


def _fadvise_tree(paths: list[str]) -> None:
    for root in paths:
        files = [root] if os.path.isfile(root) else []
        for dirpath, _, names in os.walk(root):
            files.extend(os.path.join(dirpath, n) for n in names)
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)  # DONTNEED skips dirty pages
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def drop_cache_method() -> str:
    """'drop_caches' when this process may write /proc/sys/vm/drop_caches, else 'fadvise'."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return "drop_caches"
    except OSError:
        return "fadvise"


def drop_cache(paths: list[str], method: str) -> None:
    """Evict `paths` (files or folders) from the page cache: the next read comes from disk."""
    os.sync()
    if method == "drop_caches":
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
    _fadvise_tree(paths)  # cheap; also covers pages a concurrent reader pulled in meanwhile


def cold_read(path: str, method: str) -> float:
    """Read a whole file sequentially into a 64 MiB buffer after evicting it; returns seconds."""
    return cold_read_cpu(path, method)[0]


def cold_read_cpu(path: str, method: str) -> tuple[float, float]:
    """`cold_read`, also returning the CPU seconds (this process, all threads) of the read."""
    drop_cache([path], method)
    buf = bytearray(CHUNK)
    mv = memoryview(buf)
    cpu = time.process_time()
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(mv):
            pass
    return time.perf_counter() - start, time.process_time() - cpu


def cold_read_fresh_cpu(path: str, method: str) -> tuple[float, float]:
    """`cold_read_cpu` into a buffer of the file's size allocated for it, whose pages the
    read faults in (as a load into new memory must), instead of one reused 64 MiB buffer."""
    drop_cache([path], method)
    cpu = time.process_time()
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        mv = memoryview(bytearray(os.fstat(f.fileno()).st_size))
        pos = 0
        while n := f.readinto(mv[pos : pos + CHUNK]):
            pos += n
    return time.perf_counter() - start, time.process_time() - cpu


def tree_bytes(path: str) -> int:
    """Bytes of every file under `path` (a file or a folder)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for dirpath, _, names in os.walk(path):
        total += sum(os.path.getsize(os.path.join(dirpath, n)) for n in names)
    return total


def remove(path: str) -> None:
    """Delete a baseline's output and flush the deletion before the next timed operation."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)
    os.sync()


def mem_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
