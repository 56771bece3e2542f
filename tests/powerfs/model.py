"""A POSIX filesystem under the strict crash model (ALICE / LazyFS / CrashMonkey style).

Every inode keeps a volatile view (what processes see now) and a durable view (what survives a
power cut): a file's data is durable up to its last fsync; a directory's entries (names created,
renamed in or out, unlinked) are durable as of its last fsync. After a cut, the filesystem is the
durable view of every directory reachable from the root, each file holding its durable data.

Mutating operations are recorded in an op log at the inode level (paths may be gone by the time
an open file is written), so replaying any prefix of the log rebuilds the exact state after that
op: `durable_after(oplog, k)` is "the power was cut right after the k-th op".
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

ROOT = 1
Op = tuple[Any, ...]  # (kind, *args) with inode numbers, never paths: see Model.apply
DurableTree = dict[str, bytes | None]  # relative path -> file data, or None for a directory


def _err(code: int, what: str) -> OSError:
    return OSError(code, os.strerror(code), what)


@dataclass
class Inode:
    """A file or a directory; `durable_*` is what a power cut leaves."""

    ino: int
    is_dir: bool
    mode: int
    data: bytearray = field(default_factory=bytearray)
    durable_data: bytes = b""
    entries: dict[str, int] = field(default_factory=dict)
    durable_entries: dict[str, int] = field(default_factory=dict)
    nlink: int = 1
    mtime_ns: int = field(default_factory=time.time_ns)


class Model:
    """The volatile and durable state of one filesystem, plus the log of what changed it."""

    def __init__(self) -> None:
        self.inodes: dict[int, Inode] = {ROOT: Inode(ROOT, True, 0o755, nlink=2)}
        self.next_ino = ROOT + 1
        self.log: list[Op] = []

    # ---- path resolution -------------------------------------------------------------------
    def lookup(self, path: str) -> int:
        """The inode of `path` ('/'-separated, relative to the root; '' or '/' is the root)."""
        ino = ROOT
        for part in [p for p in path.split("/") if p]:
            node = self.inodes[ino]
            if not node.is_dir:
                raise _err(errno.ENOTDIR, path)
            if part not in node.entries:
                raise _err(errno.ENOENT, path)
            ino = node.entries[part]
        return ino

    def _parent(self, path: str) -> tuple[int, str]:
        head, _, name = path.rstrip("/").rpartition("/")
        if not name:
            raise _err(errno.EINVAL, path)
        parent = self.lookup(head)
        if not self.inodes[parent].is_dir:
            raise _err(errno.ENOTDIR, path)
        return parent, name

    def _child(self, path: str) -> tuple[int, str, int]:
        parent, name = self._parent(path)
        ino = self.inodes[parent].entries.get(name)
        if ino is None:
            raise _err(errno.ENOENT, path)
        return parent, name, ino

    # ---- mutating operations (validate, then log and apply) --------------------------------
    def mkdir(self, path: str, mode: int = 0o755) -> int:
        parent, name = self._parent(path)
        if name in self.inodes[parent].entries:
            raise _err(errno.EEXIST, path)
        return self.apply(("mkdir", parent, name, self.next_ino, mode))

    def rmdir(self, path: str) -> None:
        parent, name, ino = self._child(path)
        if not self.inodes[ino].is_dir:
            raise _err(errno.ENOTDIR, path)
        if self.inodes[ino].entries:
            raise _err(errno.ENOTEMPTY, path)
        self.apply(("rmdir", parent, name))

    def create(self, path: str, mode: int = 0o644, excl: bool = False, trunc: bool = True) -> int:
        """open(O_CREAT [| O_EXCL] [| O_TRUNC]): the inode of the new or existing file."""
        parent, name = self._parent(path)
        ino = self.inodes[parent].entries.get(name)
        if ino is None:
            return self.apply(("create", parent, name, self.next_ino, mode))
        if excl:
            raise _err(errno.EEXIST, path)
        if self.inodes[ino].is_dir:
            raise _err(errno.EISDIR, path)
        if trunc and self.inodes[ino].data:
            self.truncate(ino, 0)
        return ino

    def open(self, path: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
        """open(2) with O_CREAT, O_EXCL and O_TRUNC; returns the inode."""
        if flags & os.O_CREAT:
            return self.create(path, mode, bool(flags & os.O_EXCL), bool(flags & os.O_TRUNC))
        ino = self.lookup(path)
        if flags & os.O_TRUNC and flags & os.O_ACCMODE != os.O_RDONLY:
            if self.inodes[ino].is_dir:
                raise _err(errno.EISDIR, path)
            if self.inodes[ino].data:
                self.truncate(ino, 0)
        return ino

    def write(self, ino: int, offset: int, data: bytes) -> int:
        if self.inodes[ino].is_dir:
            raise _err(errno.EISDIR, str(ino))
        self.apply(("write", ino, offset, bytes(data)))
        return len(data)

    def truncate(self, ino: int, size: int) -> None:
        if self.inodes[ino].is_dir:
            raise _err(errno.EISDIR, str(ino))
        self.apply(("truncate", ino, size))

    def fsync(self, ino: int) -> None:
        """fsync/fdatasync of a file (its data and size) or a directory (its entries)."""
        self.apply(("fsync", ino))

    def rename(self, src: str, dst: str) -> None:
        sp, sname, ino = self._child(src)
        dp, dname = self._parent(dst)
        old = self.inodes[dp].entries.get(dname)
        if old == ino:
            return  # POSIX: renaming a name onto a link of the same inode does nothing
        if old is not None:
            src_dir, dst_dir = self.inodes[ino].is_dir, self.inodes[old].is_dir
            if dst_dir and not src_dir:
                raise _err(errno.EISDIR, dst)
            if src_dir and not dst_dir:
                raise _err(errno.ENOTDIR, dst)
            if dst_dir and self.inodes[old].entries:
                raise _err(errno.ENOTEMPTY, dst)
        if self.inodes[ino].is_dir and self._is_under(dp, ino):
            raise _err(errno.EINVAL, dst)
        self.apply(("rename", sp, sname, dp, dname))

    def link(self, src: str, dst: str) -> None:
        ino = self.lookup(src)
        if self.inodes[ino].is_dir:
            raise _err(errno.EPERM, src)
        dp, dname = self._parent(dst)
        if dname in self.inodes[dp].entries:
            raise _err(errno.EEXIST, dst)
        self.apply(("link", ino, dp, dname))

    def unlink(self, path: str) -> None:
        parent, name, ino = self._child(path)
        if self.inodes[ino].is_dir:
            raise _err(errno.EISDIR, path)
        self.apply(("unlink", parent, name))

    def _is_under(self, ino: int, ancestor: int) -> bool:
        """Whether directory `ino` is `ancestor` or inside it (a rename must not make a loop)."""
        seen: set[int] = set()
        stack = [ancestor]
        while stack:
            cur = stack.pop()
            if cur == ino:
                return True
            seen.add(cur)
            node = self.inodes[cur]
            stack += [c for c in node.entries.values() if self.inodes[c].is_dir and c not in seen]
        return False

    # ---- the one place that changes state ---------------------------------------------------
    def apply(self, op: Op) -> Any:
        """Apply one logged op (already validated) and append it to the log."""
        kind, args = op[0], op[1:]
        getattr(self, f"_do_{kind}")(*args)
        self.log.append(op)
        return args[2] if kind in ("mkdir", "create") else None

    def _new(self, parent: int, name: str, ino: int, is_dir: bool, mode: int) -> None:
        self.inodes[ino] = Inode(ino, is_dir, mode, nlink=2 if is_dir else 1)
        self.next_ino = max(self.next_ino, ino + 1)
        self.inodes[parent].entries[name] = ino
        self._touch(parent)

    def _do_mkdir(self, parent: int, name: str, ino: int, mode: int) -> None:
        self._new(parent, name, ino, True, mode)

    def _do_create(self, parent: int, name: str, ino: int, mode: int) -> None:
        self._new(parent, name, ino, False, mode)

    def _do_rmdir(self, parent: int, name: str) -> None:
        ino = self.inodes[parent].entries.pop(name)
        self.inodes[ino].nlink = 0
        self._touch(parent)

    def _do_unlink(self, parent: int, name: str) -> None:
        ino = self.inodes[parent].entries.pop(name)
        self.inodes[ino].nlink -= 1
        self._touch(parent)

    def _do_write(self, ino: int, offset: int, data: bytes) -> None:
        buf = self.inodes[ino].data
        if offset > len(buf):
            buf.extend(bytes(offset - len(buf)))
        buf[offset : offset + len(data)] = data
        self._touch(ino)

    def _do_truncate(self, ino: int, size: int) -> None:
        buf = self.inodes[ino].data
        if size < len(buf):
            del buf[size:]
        else:
            buf.extend(bytes(size - len(buf)))
        self._touch(ino)

    def _do_fsync(self, ino: int) -> None:
        node = self.inodes[ino]
        if node.is_dir:
            node.durable_entries = dict(node.entries)
        else:
            node.durable_data = bytes(node.data)

    def _do_rename(self, sp: int, sname: str, dp: int, dname: str) -> None:
        ino = self.inodes[sp].entries.pop(sname)
        old = self.inodes[dp].entries.get(dname)
        if old is not None:
            self.inodes[old].nlink = 0 if self.inodes[old].is_dir else self.inodes[old].nlink - 1
        self.inodes[dp].entries[dname] = ino
        self._touch(sp)
        self._touch(dp)

    def _do_link(self, ino: int, dp: int, dname: str) -> None:
        self.inodes[dp].entries[dname] = ino
        self.inodes[ino].nlink += 1
        self._touch(dp)

    def _touch(self, ino: int) -> None:
        self.inodes[ino].mtime_ns = time.time_ns()

    # ---- reads -----------------------------------------------------------------------------
    def read(self, ino: int, offset: int, size: int) -> bytes:
        return bytes(self.inodes[ino].data[offset : offset + size])

    def readdir(self, path: str) -> list[str]:
        node = self.inodes[self.lookup(path)]
        if not node.is_dir:
            raise _err(errno.ENOTDIR, path)
        return sorted(node.entries)

    def getattr(self, ino: int) -> Inode:
        return self.inodes[ino]

    def volatile_tree(self) -> DurableTree:
        """What processes see now, in the same shape as `durable_tree`."""
        return dict(self._walk(durable=False))

    # ---- after a power cut -----------------------------------------------------------------
    def durable_tree(self) -> DurableTree:
        """What a power cut right now leaves: relative path -> durable data (None: directory)."""
        return dict(self._walk(durable=True))

    def _walk(self, durable: bool) -> Iterator[tuple[str, bytes | None]]:
        for rel, ino in self._walk_inodes(durable):
            node = self.inodes[ino]
            if node.is_dir:
                yield rel, None
            else:
                yield rel, node.durable_data if durable else bytes(node.data)

    def _walk_inodes(self, durable: bool) -> Iterator[tuple[str, int]]:
        """Depth-first, sorted. A directory that a half-durable rename left in two places is
        listed in both; a loop (impossible while running, possible after a cut) is cut off."""
        stack: list[tuple[str, int, frozenset[int]]] = [("", ROOT, frozenset({ROOT}))]
        while stack:
            rel, ino, above = stack.pop()
            node = self.inodes[ino]
            entries = node.durable_entries if durable else node.entries
            for name in sorted(entries, reverse=True):
                child = entries[name]
                path = f"{rel}/{name}" if rel else name
                if child in above:
                    continue
                if self.inodes[child].is_dir:
                    stack.append((path, child, above | {child}))
                yield path, child

    def materialize(self, dest: str) -> None:
        """Write the durable state into the empty or new real directory `dest` (hard links
        stay hard links, so a link-based create looks as it would on a real disk)."""
        os.makedirs(dest, exist_ok=True)
        first: dict[int, str] = {}
        for rel, ino in sorted(self._walk_inodes(durable=True)):
            full = os.path.join(dest, rel)
            node = self.inodes[ino]
            if node.is_dir:
                os.makedirs(full, mode=0o755, exist_ok=True)
            elif ino in first:
                os.link(first[ino], full)
            else:
                with open(full, "wb") as f:
                    f.write(node.durable_data)
                os.chmod(full, node.mode & 0o777)
                first[ino] = full


def replay(oplog: list[Op], k: int | None = None) -> Model:
    """A model with the first `k` ops of `oplog` applied (all when k is None)."""
    model = Model()
    for op in oplog if k is None else oplog[:k]:
        model.apply(op)
    return model


def durable_after(oplog: list[Op], k: int) -> DurableTree:
    """The durable state when the power is cut right after the first `k` ops."""
    return replay(oplog, k).durable_tree()


def materialize(oplog: list[Op], k: int, dest: str) -> None:
    """Replay the first `k` ops and write the durable state that a cut leaves into `dest`."""
    replay(oplog, k).materialize(dest)


def durable_states(oplog: list[Op], start: int = 0) -> Iterator[tuple[int, Model]]:
    """(k, model after k ops) for every k from `start` to len(oplog), replaying only once.
    The model is the same object each time: use it (durable_tree, materialize) before the
    next iteration."""
    model = replay(oplog, start)
    yield start, model
    for k in range(start, len(oplog)):
        model.apply(oplog[k])
        yield k + 1, model
