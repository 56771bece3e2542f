"""The S3 writer: small objects as one PUT, large ones as a parallel multipart upload; the
CRC32C (and digest) computed as the bytes pass; exclusive (create-only) completion."""

from __future__ import annotations

import errno
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointCorruptError
from .base import (
    ANOTHER,
    AlreadyExistsError,
    Checksums,
    FileRecord,
    PreconditionFailedError,
    StorageError,
    Writer,
)

if TYPE_CHECKING:
    from .s3 import S3Storage


class S3Writer(Writer):
    """Buffers up to one part; small objects are one PUT, large ones a parallel multipart
    upload with at most `max_concurrency` parts in flight (bounded memory)."""

    def __init__(self, store: S3Storage, path: str, exclusive: bool = False) -> None:
        self.store, self.path, self.exclusive = store, path, exclusive
        self._buf = bytearray()
        self._sums = Checksums(store.digest)
        self._upload_id: str | None = None
        self._parts: list[Future] = []
        self._slots = threading.Semaphore(int(store.opts["max_concurrency"]))

    def write(self, data: Any) -> None:
        mv = memoryview(data).cast("B")
        self._sums.update(mv)
        part = self.store.part_size
        while len(mv):
            take = min(part - len(self._buf), len(mv))
            self._buf += mv[:take]
            mv = mv[take:]
            if len(self._buf) >= part:
                self._send_part()

    def _send_part(self) -> None:
        s = self.store
        if self._upload_id is None:
            r = s._call("write", self.path, s.client.create_multipart_upload, Key=s.key(self.path))
            self._upload_id = r["UploadId"]
        data, self._buf = bytes(self._buf), bytearray()
        self._slots.acquire()
        number = len(self._parts) + 1
        self._parts.append(s.pool.submit(self._upload, number, data))

    def _upload(self, number: int, data: bytes) -> dict:
        s = self.store
        try:
            r = s._call("write", self.path, s.client.upload_part, Key=s.key(self.path),
                        UploadId=self._upload_id, PartNumber=number, Body=data)  # fmt: skip
            return {"PartNumber": number, "ETag": r["ETag"]}
        except FileNotFoundError:
            raise self._vanished() from None
        finally:
            self._slots.release()

    def _check_completed(self) -> None:
        """After NoSuchUpload on the completion: our own completion whose reply was lost (the
        object holds exactly these bytes), or the upload was aborted under us."""
        try:
            self.store.verify(self.path, self._sums.record(self.path))
        except (CheckpointCorruptError, FileNotFoundError):
            raise self._vanished() from None

    def _vanished(self) -> StorageError:
        """NoSuchUpload: this writer's multipart upload was aborted under it."""
        return StorageError(
            errno.EIO,
            f"{self.store.where(self.path)}: the multipart upload of this file was aborted "
            "before it completed (by another job that removed this step's folder, a crash "
            "cleanup of a job that had lost the folder's lease, or a bucket lifecycle rule); "
            "this save is not committed, nothing committed is touched; save again",
        )

    def close(self) -> FileRecord:
        s = self.store
        cond = {"IfNoneMatch": "*"} if self.exclusive else {}
        try:
            if self._upload_id is None:
                s._call("write", self.path, s.client.put_object, Key=s.key(self.path),
                        Body=bytes(self._buf), **cond)  # fmt: skip
            else:
                if self._buf:
                    self._send_part()
                parts = _wait_all(self._parts)
                s._call("write", self.path, s.client.complete_multipart_upload,
                        Key=s.key(self.path), UploadId=self._upload_id,
                        MultipartUpload={"Parts": parts}, **cond)  # fmt: skip
        except PreconditionFailedError:
            self._check_own()
        except FileNotFoundError:
            if self._upload_id is None:
                raise
            self._check_completed()
        self._buf = bytearray()
        return self._sums.record(self.path)

    def _check_own(self) -> None:
        """After a 412 on an exclusive write: the object holds exactly these bytes (our own
        try whose reply was lost, retried), or another writer made it first."""
        try:
            self.store.verify(self.path, self._sums.record(self.path))
        except (CheckpointCorruptError, FileNotFoundError):
            raise AlreadyExistsError(
                errno.EEXIST, f"{self.store.where(self.path)} already exists: {ANOTHER}"
            ) from None

    def abort(self) -> None:
        for f in self._parts:
            f.cancel()
        if self._upload_id is not None:
            s = self.store
            try:
                s.client.abort_multipart_upload(
                    Bucket=s.bucket, Key=s.key(self.path), UploadId=self._upload_id
                )
            except Exception:  # the save's own error matters more; leftovers are aborted at start
                pass
            self._upload_id = None
        self._buf = bytearray()


def _wait_all(futures: list[Future]) -> list[Any]:
    """Results in order; on the first failure cancel the rest and raise it."""
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        raise
