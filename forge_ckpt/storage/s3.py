"""S3-compatible object storage through boto3 (see docs/storage.md for why this client).

No rename, no folders, no fsync, no flock: a PUT is atomic per object and durable when it
returns; conditional writes (`If-None-Match: *`, `If-Match: <etag>`) replace rename and locks.
Large objects go up as multipart uploads whose parts are sent in parallel, and come down as
parallel ranged GETs. The CRC32C of every object is computed as its bytes pass.

Endpoint, region and credentials come from boto3's usual chain (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, profiles) unless `storage_options` name
them. Throttling, 5xx, dropped connections and timeouts are retried with exponential backoff
(botocore's "standard" mode, `max_attempts` tries in all); the timeouts and the tries bound how
long one request can block (`call_bound_s`, docs/storage.md).
"""

from __future__ import annotations

import builtins
import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from ..errors import CheckpointCorruptError
from .base import (
    AlreadyExistsError,
    Checksums,
    FileRecord,
    PreconditionFailedError,
    Storage,
    StorageError,
    StorageSpec,
    before_delete,
    check_record,
    expected_algo,
    fault,
    join,
)
from .s3_errors import call_bound_s, reply_size, translate
from .s3_writer import S3Writer, _wait_all

__all__ = ["S3Storage", "S3Writer", "call_bound_s", "parse_url"]

OPTIONS = {
    "endpoint_url": None,
    "region_name": None,
    "aws_access_key_id": None,
    "aws_secret_access_key": None,
    "aws_session_token": None,
    "profile_name": None,
    "part_size_mb": 32,
    "max_concurrency": 8,
    "max_attempts": 3,  # tries in all, the first one included
    "connect_timeout_s": 5.0,
    "read_timeout_s": 10.0,  # the longest wait for any one read or write on the connection
    "digest": None,  # not a client option: the cryptographic digest writers compute
}
# CopyObject copies at most 5 GiB (S3's rule); a larger object is copied in parts.
MULTIPART_COPY_THRESHOLD = 5 * 1024**3
_MAX_PARTS = 10_000  # S3's limit on the parts of one upload
UPLOADS_PAGE = 1000  # uploads per ListMultipartUploads page (S3's maximum)
_CLIENT_KEYS = ("endpoint_url", "region_name", "aws_access_key_id", "aws_secret_access_key")
_NOT_CLIENT = ("digest",)
_clients: dict[Any, Any] = {}
_pools: dict[int, ThreadPoolExecutor] = {}
_clients_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A forked child inherits the pools without their threads (a read would wait forever)
    and the clients' connections to the parent's sockets: it makes its own."""
    global _clients_lock
    _clients.clear()
    _pools.clear()
    _clients_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def _client(opts: dict[str, Any]) -> Any:
    """One boto3 client per process and configuration (clients are thread-safe)."""
    key = tuple(sorted((k, str(v)) for k, v in opts.items()))
    with _clients_lock:
        if key not in _clients:
            import boto3
            from botocore.config import Config

            session = boto3.session.Session(profile_name=opts["profile_name"])
            conf = Config(
                retries={"total_max_attempts": int(opts["max_attempts"]), "mode": "standard"},
                max_pool_connections=max(32, 2 * int(opts["max_concurrency"])),
                connect_timeout=float(opts["connect_timeout_s"]),
                read_timeout=float(opts["read_timeout_s"]),
                s3={"addressing_style": "path"},
            )
            kwargs = {k: opts[k] for k in _CLIENT_KEYS if opts[k] is not None}
            if opts["aws_session_token"] is not None:
                kwargs["aws_session_token"] = opts["aws_session_token"]
            _clients[key] = session.client("s3", config=conf, **kwargs)
        return _clients[key]


def parse_url(url: str) -> tuple[str, str]:
    rest = url.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r}: an S3 folder URL is s3://BUCKET/PREFIX")
    return bucket, prefix.strip("/")


class S3Storage(Storage):
    def __init__(self, spec: StorageSpec) -> None:
        unknown = sorted(set(spec.options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown storage_options {unknown}; known: {sorted(OPTIONS)}")
        self.spec = spec
        self.opts = {**OPTIONS, **spec.options}
        self.bucket, self.prefix = parse_url(spec.url)
        self.part_size = int(self.opts["part_size_mb"]) * 1024 * 1024
        self.client = _client({k: v for k, v in self.opts.items() if k not in _NOT_CLIENT})

    @property
    def pool(self) -> ThreadPoolExecutor:
        """One pool per process and concurrency (every step's storage shares it: a storage
        per step must not mean a set of threads per step)."""
        n = int(self.opts["max_concurrency"])
        with _clients_lock:
            if n not in _pools:
                _pools[n] = ThreadPoolExecutor(n, thread_name_prefix="forge-ckpt-s3")
            return _pools[n]

    def sub(self, prefix: str) -> S3Storage:
        return S3Storage(self.spec.child(prefix))

    @property
    def call_bound_s(self) -> float:
        return call_bound_s(self.opts)

    def key(self, path: str) -> str:
        return join(self.prefix, path) if self.prefix else path.strip("/")

    def folder_key(self, prefix: str) -> str:
        """The key prefix of everything inside the folder `prefix`: its key and a '/', so that
        `step-1` never matches `step-10/...` nor `runs/exp1` `runs/exp10/...` ("" at the root)."""
        k = self.key(prefix)
        return f"{k}/" if k else ""

    def _call(self, what: str, path: str, fn: Any, **kw: Any) -> Any:
        """Run one S3 call; turn its failure into an error naming the object and the cause."""
        fault("put" if what == "write" else "get")
        try:
            return fn(Bucket=self.bucket, **kw)
        except Exception as e:  # botocore raises many unrelated types
            raise translate(e, what, self.where(path), self.opts) from None

    # ---- writing ---------------------------------------------------------------------------
    def writer(self, path: str, exclusive: bool = False) -> S3Writer:
        return S3Writer(self, path, exclusive)

    def publish(self, path: str, data: bytes) -> FileRecord:
        return self.write(path, data)  # a PUT is atomic: readers see old or new

    def create(self, path: str, data: bytes) -> str:
        try:
            r = self._call("write", path, self.client.put_object, Key=self.key(path), Body=data,
                           IfNoneMatch="*")  # fmt: skip
        except PreconditionFailedError:
            tag = self._applied(path, data)
            if tag is None:
                raise AlreadyExistsError(
                    errno.EEXIST, f"{self.where(path)} already exists (written by another writer)"
                ) from None
            return tag
        return str(r["ETag"])

    def replace(self, path: str, data: bytes, tag: str) -> str:
        try:
            r = self._call(
                "write", path, self.client.put_object, Key=self.key(path), Body=data, IfMatch=tag
            )
        except PreconditionFailedError:
            new = self._applied(path, data)
            if new is None:
                raise
            return new
        return str(r["ETag"])

    def _applied(self, path: str, data: bytes) -> str | None:
        """After a 412: the tag of `path` if it holds exactly `data`, else None. The client
        retries a PUT whose reply was lost; when the lost try had been applied, the retry's
        condition fails on our own write. What create/replace write is unique per write (the
        lease has its renewal time and owner, a manifest its creation time, a marker the
        manifest's checksum), so the same bytes mean our write, not another writer's."""
        got = self.read_tagged(path)
        return got[1] if got is not None and got[0] == data else None

    def read_tagged(self, path: str) -> tuple[bytes, str] | None:
        try:
            r = self._call("read", path, self.client.get_object, Key=self.key(path))
        except FileNotFoundError:
            return None
        return r["Body"].read(), str(r["ETag"])

    # ---- reading ---------------------------------------------------------------------------
    def read(self, path: str, start: int = 0, end: int | None = None) -> bytearray:
        # The first part comes with the object's total size (Content-Range) and ETag: small
        # objects cost one request; large ones fetch their other parts in parallel, each on
        # the condition that the object is still the one the first part came from.
        stop = start + self.part_size if end is None else min(end, start + self.part_size)
        if stop <= start:
            return bytearray()
        first, total, etag = self._get(path, start, stop)
        end = total if end is None else min(end, total)
        if start + len(first) >= end:
            return first
        buf = bytearray(end - start)
        buf[: len(first)] = first
        try:
            self._fill(path, memoryview(buf), start, start + len(first), total, None, etag)
        except _OtherSize:
            raise CheckpointCorruptError(self.where(path), "object changed while read") from None
        return buf

    def read_verified(self, path: str, expected: FileRecord | None = None) -> bytearray:
        """With a record, its size is known: every part is asked for at once, each read
        straight into the buffer, and the checksum runs over the parts in order as they
        arrive, overlapping the download of the later ones."""
        if expected is None or expected.size <= self.part_size:
            return super().read_verified(path, expected)
        buf = bytearray(expected.size)
        sums = Checksums(expected_algo(expected))
        try:
            self._fill(path, memoryview(buf), 0, 0, expected.size, sums, None)
        except FileNotFoundError:
            raise CheckpointCorruptError(self.where(path), "file is missing") from None
        except _OtherSize:  # the generic path names the size it found
            return super().read_verified(path, expected)
        check_record(self.where(path), sums.size, sums.crc, expected, sums.record(path))
        return buf

    def _fill(
        self,
        path: str,
        view: memoryview,
        base: int,
        a: int,
        total: int,
        sums: Checksums | None,
        etag: str | None,
    ) -> None:
        """Bytes [a, base + len(view)) of an object of `total` bytes (and `etag`, if given)
        into `view`, which holds the object from `base`; `sums` takes every byte of `view`, in
        order. The first part is read in the calling thread, the others in the shared pool:
        a caller waits on its own request first, never only behind other callers' queued
        parts. No part is still being written into `view` once this returns or raises."""
        end = base + len(view)
        ranges = [(o, min(o + self.part_size, end)) for o in range(a, end, self.part_size)]
        args = (path, view, base, total, etag)
        futures = [self.pool.submit(self._get_into, *args, lo, hi) for lo, hi in ranges[1:]]
        try:
            if sums is not None and a > base:
                sums.update(view[: a - base])
            self._get_into(*args, *ranges[0])
            for i, (lo, hi) in enumerate(ranges):
                if i:
                    futures[i - 1].result()
                if sums is not None:
                    sums.update(view[lo - base : hi - base])
        finally:
            for f in futures:
                f.cancel()
            wait(futures)

    def _get(self, path: str, a: int, b: int) -> tuple[bytearray, int, str | None]:
        """Bytes [a, b) (fewer at the end of the object), the object's size and ETag."""
        r = self._get_range(path, a, b, None)
        if r is None:  # an empty object, or a start past its end
            return bytearray(), self.size(path) or 0, None
        try:
            data = bytearray(r["Body"].read())
        except Exception as e:  # the connection failed or timed out mid-body
            raise translate(e, "read", self.where(path), self.opts) from None
        # no Content-Range: the server ignored the Range and sent the whole object
        total = reply_size(r, self.where(path)) or a + len(data)
        return data, total, r.get("ETag")

    def _get_range(self, path: str, a: int, b: int, etag: str | None) -> dict[str, Any] | None:
        """The reply to a ranged GET (None: the range starts past the end); a reply without
        Content-Length (a real S3 always sends it: a head cut off) is an error."""
        cond = {} if etag is None else {"IfMatch": etag}
        try:
            r = self._call("read", path, self.client.get_object, Key=self.key(path),
                           Range=f"bytes={a}-{b - 1}", **cond)  # fmt: skip
        except StorageError as e:
            if "InvalidRange" in str(e):
                return None
            raise
        if r.get("ContentLength") is None:
            r["Body"].close()
            raise StorageError(errno.EIO, f"{self.where(path)}: read failed: a reply without "
                               "Content-Length; the connection to the S3 endpoint broke?")  # fmt: skip
        return r

    def _get_into(
        self, path: str, view: memoryview, base: int, total: int, etag: str | None, a: int, b: int
    ) -> None:
        """Bytes [a, b) of an object of `total` bytes, read from the socket into `view`."""
        try:
            r = self._get_range(path, a, b, etag)
        except PreconditionFailedError:  # replaced since the first part was read
            raise _OtherSize(path) from None
        if r is None or reply_size(r, self.where(path)) != total:
            raise _OtherSize(path)
        out, got = view[a - base : b - base], 0
        body = r["Body"]
        try:
            while got < b - a:
                n = body.readinto(out[got:])
                if not n:
                    break
                got += n
        except Exception as e:  # the connection failed or timed out mid-body
            raise translate(e, "read", self.where(path), self.opts) from None
        finally:
            body.close()
        if got != b - a:
            raise CheckpointCorruptError(self.where(path), f"object changed while read at byte {a}")

    def size(self, path: str) -> int | None:
        try:
            r = self._call("read", path, self.client.head_object, Key=self.key(path))
        except FileNotFoundError:
            return None
        return int(r["ContentLength"])

    def _pages(self, prefix: str, delimiter: str | None = None) -> Any:
        kw = {"Bucket": self.bucket, "Prefix": self.folder_key(prefix)}
        if delimiter:
            kw["Delimiter"] = delimiter
        try:
            yield from self.client.get_paginator("list_objects_v2").paginate(**kw)
        except Exception as e:
            raise translate(e, "list", self.where(prefix), self.opts) from None

    def list(self, prefix: str = "") -> builtins.list[str]:
        # Derived from the objects themselves, not from common prefixes: some S3-compatible
        # stores (SeaweedFS) keep listing a "folder" for a while after its last object went.
        return sorted({p.split("/", 1)[0] for p, _ in self.walk(prefix, relative_to=prefix)})

    def walk(self, prefix: str = "", relative_to: str = "") -> builtins.list[tuple[str, int]]:
        base = self.key(relative_to)
        cut = len(base) + 1 if base else 0
        out = []
        for page in self._pages(prefix, None):
            for o in page.get("Contents", []):
                if not o["Key"].endswith("/"):  # folder markers some stores list
                    out.append((o["Key"][cut:], int(o["Size"])))
        return sorted(out)

    # ---- deleting and moving ---------------------------------------------------------------
    def delete(self, path: str) -> None:
        before_delete()  # what came before (a move's copies) may have taken long
        self._call("write", path, self.client.delete_object, Key=self.key(path))

    def delete_prefix(self, prefix: str) -> None:
        keys = [self.key(p) for p, _ in self.walk(prefix)]
        for i in range(0, len(keys), 1000):
            before_delete()  # the listing may have taken long: still the folder's writer?
            batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            r = self._call("write", prefix, self.client.delete_objects, Delete=batch)
            if r.get("Errors"):
                err = r["Errors"][0]
                raise StorageError(
                    errno.EIO, f"{self.where(err['Key'])}: delete failed: {err.get('Message')}"
                )
        self.abort_uploads(prefix)

    def abort_uploads(self, prefix: str = "") -> int:
        """Abort multipart uploads left inside the folder `prefix` by crashed writers (they
        cost storage). At the bucket root the folder shares the bucket with whatever else is
        in it: there, only uploads of forge_ckpt's own names (step folders, quarantine) go."""
        uploads = self._uploads(prefix)
        if not self.folder_key(prefix):
            uploads = [u for u in uploads if _ours_at_root(u["Key"])]
        n = int(self.opts["max_concurrency"])
        for i in range(0, len(uploads), n):
            # Fenced like a delete: a listing answered after a take-over names the uploads
            # of the successor's save in progress.
            before_delete()
            _wait_all([self.pool.submit(self._abort, prefix, u["Key"], u["UploadId"])
                       for u in uploads[i : i + n]])  # fmt: skip
        return len(uploads)

    def _uploads(self, prefix: str) -> builtins.list[dict[str, Any]]:
        """Every unfinished upload in the folder, across pages (KeyMarker / UploadIdMarker)."""
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket,
            Prefix=self.folder_key(prefix),
            PaginationConfig={"PageSize": UPLOADS_PAGE},
        )
        try:
            return [u for page in pages for u in page.get("Uploads", [])]
        except Exception as e:
            raise translate(e, "list uploads", self.where(prefix), self.opts) from None

    def _abort(self, prefix: str, key: str, upload_id: str) -> None:
        try:
            self._call("write", prefix, self.client.abort_multipart_upload, Key=key,
                       UploadId=upload_id)  # fmt: skip
        except FileNotFoundError:  # NoSuchUpload: finished or aborted meanwhile
            pass

    def move_prefix(self, src: str, dst: str, first: str | None = None) -> None:
        """Copy every object (in parallel, large ones in parts), `first` last, then delete
        `first` before the others (see Storage.move_prefix)."""
        cut = len(src.strip("/")) + 1
        moves = [(p, join(dst, p[cut:]), size) for p, size in self.walk(src)]
        try:
            self._copy_all([m for m in moves if m[0] != first])
            self._copy_all([m for m in moves if m[0] == first])  # the copy is whole only then
        except BaseException:
            _quietly(self.delete_prefix, dst)  # a half copy is not worth keeping; src is whole
            raise
        if first is not None:
            self.delete(first)
        self.delete_prefix(src)

    def _copy_all(self, moves: builtins.list[tuple[str, str, int]]) -> None:
        """Server-side copies on the pool: one CopyObject per object up to
        MULTIPART_COPY_THRESHOLD, UploadPartCopy parts above it (CopyObject stops at 5 GiB)."""
        small = [(s, d) for s, d, n in moves if n <= MULTIPART_COPY_THRESHOLD]
        futures = [self.pool.submit(self._copy, s, d) for s, d in small]
        uploads: builtins.list[tuple[str, str, builtins.list[Future]]] = []
        try:
            for s, d, n in moves:
                if n > MULTIPART_COPY_THRESHOLD:
                    r = self._call("write", d, self.client.create_multipart_upload, Key=self.key(d))
                    parts = [self.pool.submit(self._copy_part, s, d, r["UploadId"], i + 1, a, b)
                             for i, (a, b) in enumerate(self._copy_ranges(n))]  # fmt: skip
                    uploads.append((d, r["UploadId"], parts))
            _wait_all(futures + [f for _, _, parts in uploads for f in parts])
            for d, upload_id, parts in uploads:
                done = {"Parts": [f.result() for f in parts]}
                self._call("write", d, self.client.complete_multipart_upload, Key=self.key(d),
                           UploadId=upload_id, MultipartUpload=done)  # fmt: skip
        except BaseException:
            running = futures + [f for _, _, parts in uploads for f in parts]
            for f in running:
                f.cancel()
            wait(running)  # none may land after the cleanup
            for d, upload_id, _ in uploads:
                _quietly(self._abort, d, self.key(d), upload_id)
            raise

    def _copy_ranges(self, size: int) -> builtins.list[tuple[int, int]]:
        part = max(self.part_size, -(-size // _MAX_PARTS))
        return [(a, min(a + part, size)) for a in range(0, size, part)]

    def _copy(self, src: str, dst: str) -> None:
        self._call("write", dst, self.client.copy_object, Key=self.key(dst),
                   CopySource={"Bucket": self.bucket, "Key": self.key(src)})  # fmt: skip

    def _copy_part(self, src: str, dst: str, upload_id: str, number: int, a: int, b: int) -> dict:
        r = self._call("write", dst, self.client.upload_part_copy, Key=self.key(dst),
                       UploadId=upload_id, PartNumber=number, CopySourceRange=f"bytes={a}-{b - 1}",
                       CopySource={"Bucket": self.bucket, "Key": self.key(src)})  # fmt: skip
        return {"PartNumber": number, "ETag": r["CopyPartResult"]["ETag"]}


def _quietly(fn: Any, *args: Any) -> None:
    """Clean up after a failure whose own error matters more (leftovers go at the next start)."""
    try:
        fn(*args)
    except OSError:
        pass


def _ours_at_root(key: str) -> bool:
    """A key forge_ckpt writes in a folder at the bucket root: `step-N/...`, `quarantine/...`."""
    from ..steps.layout import QUARANTINE, parse_step  # the layout imports the storage package

    top = key.split("/", 1)[0]
    return parse_step(top) is not None or top == QUARANTINE


class _OtherSize(Exception):
    """The object is not of the size its record or first part said (replaced, or a server
    that ignores ranges): the read starts over the generic way."""
