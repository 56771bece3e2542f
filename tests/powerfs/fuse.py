"""The crash model of `model.py` mounted with FUSE, so real processes can save onto it.

Run as `python -m powerfs.fuse MOUNTPOINT CONTROL_SOCKET` (with tests/ on PYTHONPATH); the test
side is `PowerFS`. Every FUSE call becomes a model operation, so a checkpoint save from several
processes leaves an op log; `PowerFS.oplog()` fetches it through the control socket and
`materialize(oplog, k, dest)` writes what a power cut right after op k would leave.
The filesystem runs single-threaded: ops are applied in the order the kernel delivers them.
"""

from __future__ import annotations

import ctypes.util
import errno
import functools
import os
import pickle
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from .model import Model, Op, materialize

_CONTROL_TIMEOUT_S = 30.0


def _locked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Serialize FUSE callbacks with the control thread that dumps the log."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any) -> Any:
        with self._mutex:
            return fn(self, *args)

    return wrapper


class PowerOps:
    """FUSE callbacks onto a `Model` (mfusepy registers the methods that exist); open files
    are tracked by handle -> inode, so a file unlinked or renamed while open is still written
    to the right inode."""

    use_ns = True

    def __init__(self) -> None:
        self.model = Model()
        self._mutex = threading.Lock()
        self.handles: dict[int, int] = {}
        self.next_fh = 1

    def init_with_config(self, conn: Any, config: Any) -> None:
        if config is not None:  # unlink really unlinks (no .fuse_hidden renames in the log)
            config.hard_remove = 1
            config.use_ino = 1

    def _ino(self, path: str | None, fh: int | None = None) -> int:
        if fh is not None and fh in self.handles:
            return self.handles[fh]
        if path is None:
            raise OSError(errno.EBADF, "no path and no open handle")
        return self.model.lookup(path)

    def _handle(self, ino: int) -> int:
        fh, self.next_fh = self.next_fh, self.next_fh + 1
        self.handles[fh] = ino
        return fh

    @_locked
    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, Any]:
        node = self.model.getattr(self._ino(path, fh))
        kind = stat.S_IFDIR if node.is_dir else stat.S_IFREG
        size = len(node.entries) if node.is_dir else len(node.data)
        t = node.mtime_ns
        return {
            "st_mode": kind | (node.mode & 0o7777),
            "st_ino": node.ino,
            "st_nlink": max(node.nlink, 1),
            "st_size": size,
            "st_uid": os.getuid(),
            "st_gid": os.getgid(),
            "st_blksize": 4096,
            "st_blocks": (size + 511) // 512,
            "st_atime": t,
            "st_mtime": t,
            "st_ctime": t,
        }

    @_locked
    def readdir(self, path: str | None, fh: int) -> list[tuple[str, dict[str, int], int]]:
        """Entries with their inode numbers (with use_ino, an entry of inode 0 would be
        hidden by libc)."""
        ino = self._ino(path, fh)
        entries = {".": ino, "..": ino, **self.model.getattr(ino).entries}
        out = []
        for name, child in entries.items():
            kind = stat.S_IFDIR if self.model.getattr(child).is_dir else stat.S_IFREG
            out.append((name, {"st_ino": child, "st_mode": kind}, 0))
        return out

    @_locked
    def opendir(self, path: str) -> int:
        return self._handle(self.model.lookup(path))

    @_locked
    def releasedir(self, path: str | None, fh: int) -> None:
        self.handles.pop(fh, None)

    @_locked
    def fsyncdir(self, path: str | None, datasync: int, fh: int) -> None:
        self.model.fsync(self._ino(path, fh))

    @_locked
    def mkdir(self, path: str, mode: int) -> None:
        self.model.mkdir(path, mode & 0o7777)

    @_locked
    def rmdir(self, path: str) -> None:
        self.model.rmdir(path)

    @_locked
    def create(self, path: str, mode: int, flags: int = os.O_CREAT) -> int:
        excl, trunc = bool(flags & os.O_EXCL), bool(flags & os.O_TRUNC)
        return self._handle(self.model.create(path, mode & 0o7777, excl, trunc))

    @_locked
    def open(self, path: str, flags: int) -> int:
        return self._handle(self.model.open(path, flags & ~os.O_CREAT))

    @_locked
    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        return self.model.read(self._ino(path, fh), offset, size)

    @_locked
    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        return self.model.write(self._ino(path, fh), offset, data)

    @_locked
    def truncate(self, path: str | None, length: int, fh: int | None = None) -> None:
        self.model.truncate(self._ino(path, fh), length)

    @_locked
    def flush(self, path: str | None, fh: int) -> None:
        """close() promises nothing about durability: nothing to do."""

    @_locked
    def release(self, path: str | None, fh: int) -> None:
        self.handles.pop(fh, None)

    @_locked
    def fsync(self, path: str | None, datasync: int, fh: int) -> None:
        self.model.fsync(self._ino(path, fh))

    @_locked
    def rename(self, old: str, new: str) -> None:
        self.model.rename(old, new)

    @_locked
    def link(self, target: str, source: str) -> None:
        self.model.link(source, target)

    @_locked
    def unlink(self, path: str) -> None:
        self.model.unlink(path)

    @_locked
    def chmod(self, path: str | None, mode: int) -> None:
        """Permissions are volatile metadata here (not logged: no durability question)."""
        node = self.model.getattr(self._ino(path))
        node.mode = mode & 0o7777

    def chown(self, path: str | None, uid: int, gid: int) -> None:
        """Every process here runs as the same user: owners are not modelled."""

    @_locked
    def utimens(self, path: str | None, times: tuple[int, int] | None = None) -> None:
        node = self.model.getattr(self._ino(path))
        node.mtime_ns = times[1] if times else time.time_ns()

    def access(self, path: str, amode: int) -> None:
        """Permissions are not modelled: every access is allowed."""

    def statfs(self, path: str) -> dict[str, int]:
        free = 1 << 24
        return {
            "f_bsize": 4096,
            "f_frsize": 4096,
            "f_blocks": free,
            "f_bfree": free,
            "f_bavail": free,
            "f_files": free,
            "f_ffree": free,
            "f_namemax": 255,
        }

    def dump(self, dest: str) -> int:
        """Write the op log (a pickled list of ops) to `dest`; returns its length."""
        with self._mutex:
            log = list(self.model.log)
        with open(dest, "wb") as f:
            pickle.dump(log, f, protocol=pickle.HIGHEST_PROTOCOL)
        return len(log)


def _serve_control(ops: Any, control: str) -> None:
    """Answer `oplog PATH` (dump the log there, reply `ok N`) and `ping` on a unix socket."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(control)
    srv.listen(4)
    while True:
        conn, _ = srv.accept()
        with conn, conn.makefile("rw") as f:
            cmd, _, arg = f.readline().strip().partition(" ")
            try:
                reply = f"ok {ops.dump(arg)}" if cmd == "oplog" else "ok" if cmd == "ping" else "?"
            except Exception as e:  # the test reads the reason instead of hanging
                reply = f"error {e!r}"
            f.write(reply + "\n")


def _fuse_class() -> Any:
    """mfusepy drops the file handle of ftruncate on libfuse 3; an unlinked open file has no
    path, so pass the handle on."""
    import mfusepy

    class FUSE(mfusepy.FUSE):
        def truncate_fuse_3(self, path: bytes | None, length: int, fip: Any) -> int:
            fh = fip.contents.fh if fip else None
            name = None if path is None else path.decode(self.encoding, self.errors)
            return self.operations.truncate(name, length, fh)

    return FUSE


def main(argv: list[str]) -> None:
    """Mount in the foreground, single-threaded, until `fusermount3 -u` unmounts."""
    mountpoint, control = argv
    ops = PowerOps()
    threading.Thread(target=_serve_control, args=(ops, control), daemon=True).start()
    _fuse_class()(ops, mountpoint, foreground=True, nothreads=True, fsname="powerfs")


class FuseUnavailable(RuntimeError):
    """This machine cannot mount a FUSE filesystem (the message says why)."""


def fuse_unavailable() -> str | None:
    """Why FUSE cannot work here, or None when /dev/fuse, libfuse and fusermount3 are there."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE in this kernel or container)"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as e:
        return f"cannot open /dev/fuse: {e}"
    if not (ctypes.util.find_library("fuse3") or ctypes.util.find_library("fuse")):
        return "libfuse is not installed (Debian: apt-get install fuse3)"
    if shutil.which("fusermount3") is None and shutil.which("fusermount") is None:
        return "fusermount3 is not installed (Debian: apt-get install fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:
        return f"mfusepy cannot be imported: {e}"
    return None


class PowerFS:
    """The filesystem process: `start()` mounts on an empty folder, `stop()` always unmounts
    and ends it; `oplog()` fetches the op log so far. Also a context manager."""

    def __init__(self, mountpoint: str) -> None:
        self.mountpoint = os.path.abspath(mountpoint)
        self._dir = ""  # made by start(): short, since unix socket paths are short
        self.control = self.logfile = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> PowerFS:
        reason = fuse_unavailable()
        if reason:
            raise FuseUnavailable(reason)
        os.makedirs(self.mountpoint, exist_ok=True)
        if os.listdir(self.mountpoint):
            raise FuseUnavailable(f"mountpoint {self.mountpoint} is not empty")
        self._dir = tempfile.mkdtemp(prefix="powerfs-")
        self.control = os.path.join(self._dir, "ctl.sock")
        self.logfile = os.path.join(self._dir, "fs.log")
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
        with open(self.logfile, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "powerfs.fuse", self.mountpoint, self.control],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while not (self.mounted() and os.path.exists(self.control)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self._log_tail()
                self.stop()
                raise FuseUnavailable(f"mounting failed: {tail or 'no output'}")
            time.sleep(0.05)
        return self

    def mounted(self) -> bool:
        """From the mount table: a mount whose process died fails stat (ENOTCONN), so
        os.path.ismount would miss it and leave it behind."""
        escaped = self.mountpoint.replace("\\", "\\134").replace(" ", "\\040")
        with open("/proc/self/mounts") as f:
            return any(line.split()[1] == escaped for line in f if len(line.split()) > 1)

    def _log_tail(self) -> str:
        try:
            with open(self.logfile, errors="replace") as f:
                return f.read()[-2000:].strip()
        except OSError:
            return ""

    def _command(self, line: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(_CONTROL_TIMEOUT_S)
            s.connect(self.control)
            s.sendall(line.encode() + b"\n")
            reply = s.makefile().readline().strip()
        if not reply.startswith("ok"):
            raise RuntimeError(f"powerfs control {line!r} failed: {reply!r}")
        return reply

    def oplog(self) -> list[Op]:
        """Every mutating op so far, in the order the filesystem applied them."""
        dest = os.path.join(self._dir, "oplog.pickle")
        self._command(f"oplog {dest}")
        with open(dest, "rb") as f:
            log: list[Op] = pickle.load(f)
        os.unlink(dest)
        return log

    def materialize(self, k: int, dest: str, oplog: list[Op] | None = None) -> None:
        """Write the durable state a cut right after op k leaves into `dest`."""
        materialize(self.oplog() if oplog is None else oplog, k, dest)

    def stop(self) -> None:
        """Unmount (lazily if busy) and end the process; safe to call more than once."""
        tool = shutil.which("fusermount3") or shutil.which("fusermount") or "fusermount3"
        if self.mounted():
            for flags in ("-u", "-uz"):
                done = subprocess.run([tool, flags, self.mountpoint], capture_output=True)
                if done.returncode == 0:
                    break
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    def __enter__(self) -> PowerFS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_or_skip(mountpoint: str) -> PowerFS:
    """For tests: a started PowerFS, or pytest.skip with the reason FUSE cannot work here."""
    import pytest

    try:
        return PowerFS(mountpoint).start()
    except FuseUnavailable as e:
        print(f"powerfs: skipping, {e}", file=sys.stderr)
        pytest.skip(f"FUSE power-loss filesystem unavailable: {e}")
        raise  # unreachable: skip raises


if __name__ == "__main__":
    main(sys.argv[1:])
