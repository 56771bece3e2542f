"""The power-loss filesystem: the strict crash model, then the same model behind a FUSE mount.

The model must drop exactly what POSIX does not promise (names before their directory's fsync,
data before its file's fsync) and keep what it does; the mount must turn real syscalls, from
this process and from another one, into the same op log the model would record.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
from powerfs.fuse import start_or_skip
from powerfs.model import Model, durable_after, durable_states, materialize, replay

OLD, NEW = b"old content", b"new content, longer than the old one"


def write_file(m: Model, path: str, data: bytes, fsync: bool = True) -> int:
    ino = m.create(path)
    m.write(ino, 0, data)
    if fsync:
        m.fsync(ino)
    return ino


def fsync_dir(m: Model, path: str) -> None:
    m.fsync(m.lookup(path))


def durable_file(m: Model, path: str, data: bytes) -> None:
    """A file whose data and name are both durable (the starting point of most tests)."""
    write_file(m, path, data)
    fsync_dir(m, os.path.dirname(path))


# ---- the model ----------------------------------------------------------------------------


def test_fsynced_file_without_dir_fsync_disappears():
    m = Model()
    write_file(m, "f", b"data")
    assert m.volatile_tree() == {"f": b"data"}
    assert m.durable_tree() == {}
    fsync_dir(m, "")
    assert m.durable_tree() == {"f": b"data"}


def test_dir_fsynced_but_data_not_is_empty_or_last_fsynced():
    m = Model()
    ino = write_file(m, "f", b"first", fsync=False)
    fsync_dir(m, "")
    assert m.durable_tree() == {"f": b""}
    m.fsync(ino)
    m.write(ino, 0, b"FIRST and more")
    assert m.durable_tree() == {"f": b"first"}  # the last fsynced data, never a mix
    m.truncate(ino, 2)
    assert m.durable_tree() == {"f": b"first"}
    m.fsync(ino)
    assert m.durable_tree() == {"f": b"FI"}


def atomic_replace(m: Model, path: str, data: bytes, fsync_tmp: bool = True) -> None:
    write_file(m, path + ".tmp", data, fsync=fsync_tmp)
    m.rename(path + ".tmp", path)
    fsync_dir(m, os.path.dirname(path))


def test_atomic_replace_is_old_or_new_at_every_cut():
    m = Model()
    m.mkdir("d")
    fsync_dir(m, "")
    durable_file(m, "d/f", OLD)
    start = len(m.log)
    atomic_replace(m, "d/f", NEW)
    seen = []
    for k, state in durable_states(m.log, start):
        tree = state.durable_tree()
        assert tree["d/f"] in (OLD, NEW), f"cut after op {k}: {tree['d/f']!r}"
        assert tree == durable_after(m.log, k)  # incremental replay equals replay from zero
        seen.append(tree["d/f"])
    assert seen[0] == OLD and seen[-1] == NEW


def test_replace_without_fsync_of_the_temp_file_can_leave_an_empty_file():
    """The classic bug the model must catch: rename before fsync of the data."""
    m = Model()
    durable_file(m, "f", OLD)
    atomic_replace(m, "f", NEW, fsync_tmp=False)
    assert m.volatile_tree() == {"f": NEW}
    assert m.durable_tree() == {"f": b""}


def test_rename_without_dir_fsync_reverts():
    m = Model()
    durable_file(m, "a", OLD)
    m.rename("a", "b")
    assert m.volatile_tree() == {"b": OLD}
    assert m.durable_tree() == {"a": OLD}
    fsync_dir(m, "")
    assert m.durable_tree() == {"b": OLD}


def test_rename_across_directories_needs_both_fsyncs():
    m = Model()
    m.mkdir("src")
    m.mkdir("dst")
    fsync_dir(m, "")
    durable_file(m, "src/f", OLD)
    m.rename("src/f", "dst/f")
    fsync_dir(m, "dst")
    assert m.durable_tree() == {"dst": None, "dst/f": OLD, "src": None, "src/f": OLD}
    fsync_dir(m, "src")
    assert m.durable_tree() == {"dst": None, "dst/f": OLD, "src": None}


def test_link_based_create():
    """temp + fsync + link + unlink temp + fsync(dir): the name is durable only at the end."""
    m = Model()
    write_file(m, "COMMIT.tmp", b"marker")
    m.link("COMMIT.tmp", "COMMIT")
    with pytest.raises(FileExistsError):
        m.link("COMMIT.tmp", "COMMIT")
    m.unlink("COMMIT.tmp")
    assert m.durable_tree() == {}
    assert m.getattr(m.lookup("COMMIT")).nlink == 1
    fsync_dir(m, "")
    assert m.durable_tree() == {"COMMIT": b"marker"}


def test_unlink_without_dir_fsync_comes_back():
    m = Model()
    durable_file(m, "f", OLD)
    m.unlink("f")
    assert m.volatile_tree() == {}
    assert m.durable_tree() == {"f": OLD}
    fsync_dir(m, "")
    assert m.durable_tree() == {}


def test_mkdir_entry_needs_parent_fsync_and_children_their_own():
    m = Model()
    m.mkdir("a")
    m.mkdir("a/b")
    write_file(m, "a/b/f", b"x")
    fsync_dir(m, "a")
    fsync_dir(m, "a/b")
    assert m.durable_tree() == {}  # a itself is not in the root's durable entries
    fsync_dir(m, "")
    assert m.durable_tree() == {"a": None, "a/b": None, "a/b/f": b"x"}
    m.unlink("a/b/f")
    m.rmdir("a/b")
    fsync_dir(m, "a")
    assert m.durable_tree() == {"a": None}


def test_posix_errors_and_replacing_rename():
    m = Model()
    durable_file(m, "f", OLD)
    durable_file(m, "g", NEW)
    m.mkdir("d")
    write_file(m, "d/x", b"")
    for call, code in [
        (lambda: m.create("f", excl=True), errno.EEXIST),
        (lambda: m.rmdir("d"), errno.ENOTEMPTY),
        (lambda: m.rename("f", "d"), errno.EISDIR),
        (lambda: m.rename("d", "d/x"), errno.ENOTDIR),
        (lambda: m.unlink("d"), errno.EISDIR),
        (lambda: m.lookup("f/x"), errno.ENOTDIR),
        (lambda: m.open("nope"), errno.ENOENT),
    ]:
        with pytest.raises(OSError) as info:
            call()
        assert info.value.errno == code
    m.rename("g", "f")  # replaces f
    assert m.volatile_tree()["f"] == NEW and "g" not in m.volatile_tree()
    assert m.durable_tree()["f"] == OLD and m.durable_tree()["g"] == NEW
    fsync_dir(m, "")
    assert m.durable_tree()["f"] == NEW and "g" not in m.durable_tree()
    ino = m.open("f", os.O_WRONLY | os.O_TRUNC)
    assert m.read(ino, 0, 100) == b""


def test_materialize_writes_durable_state_with_hard_links(tmp_path):
    m = Model()
    m.mkdir("d")
    fsync_dir(m, "")
    write_file(m, "d/a", b"payload")
    m.link("d/a", "d/b")
    write_file(m, "d/lost", b"never named durably")
    fsync_dir(m, "d")
    m.unlink("d/b")  # not durable: b survives the cut
    m.rename("d/a", "d/c")
    materialize(m.log, len(m.log), str(tmp_path / "cut"))
    d = tmp_path / "cut" / "d"
    assert sorted(os.listdir(d)) == ["a", "b", "lost"]
    assert (d / "a").read_bytes() == b"payload" and (
        d / "lost"
    ).read_bytes() == b"never named durably"
    assert os.stat(d / "a").st_ino == os.stat(d / "b").st_ino
    assert replay(m.log, 1).durable_tree() == {}


# ---- through a FUSE mount -----------------------------------------------------------------


@pytest.fixture
def powerfs(tmp_path):
    fs = start_or_skip(str(tmp_path / "mnt"))
    try:
        yield fs
    finally:
        fs.stop()


def sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)  # the kernel sends FUSE_FSYNCDIR
    finally:
        os.close(fd)


def put(path: str, data: bytes, fsync: bool = True) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def test_mount_records_the_syscalls_of_an_atomic_replace(powerfs, tmp_path):
    mnt = powerfs.mountpoint
    os.mkdir(f"{mnt}/d", 0o755)
    sync_dir(mnt)
    put(f"{mnt}/d/f", OLD)
    sync_dir(f"{mnt}/d")
    start = len(powerfs.oplog())
    put(f"{mnt}/d/f.tmp", NEW)
    os.rename(f"{mnt}/d/f.tmp", f"{mnt}/d/f")
    sync_dir(f"{mnt}/d")
    assert open(f"{mnt}/d/f", "rb").read() == NEW and os.listdir(f"{mnt}/d") == ["f"]
    log = powerfs.oplog()
    assert log == [
        ("mkdir", 1, "d", 2, 0o755),
        ("fsync", 1),
        ("create", 2, "f", 3, 0o644),
        ("write", 3, 0, OLD),
        ("fsync", 3),
        ("fsync", 2),
        ("create", 2, "f.tmp", 4, 0o644),
        ("write", 4, 0, NEW),
        ("fsync", 4),
        ("rename", 2, "f.tmp", 2, "f"),
        ("fsync", 2),
    ]
    expected = {k: OLD for k in range(start, start + 5)} | {start + 5: NEW}  # NEW at dir fsync
    for k, data in expected.items():
        dest = tmp_path / f"cut{k}"
        powerfs.materialize(k, str(dest), log)
        assert os.listdir(dest / "d") == ["f"] and (dest / "d" / "f").read_bytes() == data


CHILD = """
import os, sys
mnt = sys.argv[1]
fd = os.open(mnt + "/c.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
os.write(fd, b"from a child")
os.fdatasync(fd)
os.close(fd)
os.link(mnt + "/c.tmp", mnt + "/c")
os.unlink(mnt + "/c.tmp")
fd = os.open(mnt + "/gone", os.O_WRONLY | os.O_CREAT, 0o644)
os.unlink(mnt + "/gone")          # still open: written through the handle
os.write(fd, b"unnamed")
os.ftruncate(fd, 7)
os.fsync(fd)
os.close(fd)
dfd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
os.fsync(dfd)
os.close(dfd)
put = os.open(mnt + "/late", os.O_WRONLY | os.O_CREAT, 0o644)
os.write(put, b"after the last directory fsync")
os.fsync(put)
os.close(put)
"""


def test_mount_from_a_subprocess_link_unlink_and_open_unlinked(powerfs, tmp_path):
    mnt = powerfs.mountpoint
    subprocess.run([sys.executable, "-c", CHILD, mnt], check=True, timeout=30)
    assert sorted(os.listdir(mnt)) == ["c", "late"]
    log = powerfs.oplog()
    kinds = [op[0] for op in log]
    assert kinds == ["create", "write", "fsync", "link", "unlink"] + [
        "create", "unlink", "write", "truncate", "fsync", "fsync", "create", "write", "fsync"
    ]  # fmt: skip
    assert log[7] == ("write", 3, 0, b"unnamed") and log[8] == ("truncate", 3, 7)
    assert log[10] == ("fsync", 1)
    for k in range(len(log) + 1):  # "c" appears with the root's fsync; "late" never does
        dest = tmp_path / f"cut{k}"
        powerfs.materialize(k, str(dest), log)
        assert read_tree(dest) == ({"c": b"from a child"} if k > 10 else {}), f"cut after {k}"
    assert os.stat(tmp_path / "cut11" / "c").st_mode & 0o777 == 0o600


def read_tree(root) -> dict[str, bytes | None]:
    """A real directory in the shape of Model.durable_tree."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirs, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for name in dirs + files:
            path = os.path.normpath(os.path.join(rel, name))
            full = os.path.join(dirpath, name)
            out[path] = None if name in dirs else open(full, "rb").read()
    return out


def test_mount_getattr_truncate_statfs_chmod_utime(powerfs):
    mnt = powerfs.mountpoint
    put(f"{mnt}/f", b"0123456789")
    os.truncate(f"{mnt}/f", 4)
    with open(f"{mnt}/f", "r+b") as f:
        f.truncate(2)
        f.seek(6)
        f.write(b"xy")
    os.chmod(f"{mnt}/f", 0o600)
    os.utime(f"{mnt}/f", ns=(10**18, 10**18))
    st = os.stat(f"{mnt}/f")
    assert (st.st_size, st.st_mode & 0o777, st.st_mtime_ns) == (8, 0o600, 10**18)
    assert open(f"{mnt}/f", "rb").read() == b"01\0\0\0\0xy"
    assert os.statvfs(mnt).f_namemax == 255
    with pytest.raises(FileExistsError):
        os.open(f"{mnt}/f", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    model = replay(powerfs.oplog())
    assert model.volatile_tree() == {"f": b"01\0\0\0\0xy"}
    assert model.durable_tree() == {}
