"""An S3 server in memory, with a boto3-shaped client, so the real `S3Storage` runs in the
simulation: strong read-after-write, conditional PUT (`If-None-Match: *`, `If-Match`),
paginated listings with prefixes and delimiters, multipart uploads (listed, aborted, copied
part by part) and CopyObject.

Every request first passes the simulation's gate (world.py), which may delay it, fail it
before it applies, or apply it and lose the reply, as a client with retries would see it:
a retried conditional PUT then fails its precondition against its own first attempt.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from botocore.exceptions import ClientError

from .loop import Crash

PAGE = 5  # small pages, so that every listing is paginated in the simulation


def _error(code: str, status: int, op: str) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        op,
    )


class Bucket:
    """The server's state: objects and unfinished multipart uploads."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, str]] = {}
        self.uploads: dict[str, tuple[str, dict[int, bytes]]] = {}
        self._ids = itertools.count(1)
        self._keys: list[str] | None = []  # the keys in order; None: to sort again

    def put(self, key: str, data: bytes) -> str:
        etag = '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"'
        if key not in self.objects:
            self._keys = None
        self.objects[key] = (bytes(data), etag)
        return etag

    def delete(self, key: str) -> None:
        if self.objects.pop(key, None) is not None:
            self._keys = None

    def keys_from(self, prefix: str, after: str) -> Iterator[str]:
        """The keys under `prefix` greater than `after`, in order."""
        if self._keys is None:
            self._keys = sorted(self.objects)
        keys = self._keys
        i = max(bisect.bisect_left(keys, prefix), bisect.bisect_right(keys, after))
        while i < len(keys) and keys[i].startswith(prefix):
            yield keys[i]
            i += 1

    def new_upload(self, key: str) -> str:
        uid = f"upload-{next(self._ids)}"
        self.uploads[uid] = (key, {})
        return uid


Gate = Callable[[str, str, bool], str]  # (operation, key, mutates) -> "ok" | "lost"


class Client:
    """The subset of boto3's S3 client that S3Storage uses."""

    def __init__(self, bucket: Bucket, gate: Gate, name: str = "b") -> None:
        self.b, self._gate, self.name = bucket, gate, name

    def _pass(self, op: str, key: str, mutates: bool) -> str:
        """The gate's outcome; 'fail' is raised here, before anything applies."""
        outcome = self._gate(op, key, mutates)
        if outcome == "fail":
            raise _error("InternalError", 500, op)
        return outcome

    @staticmethod
    def _reply(outcome: str) -> None:
        """After the request applied: a process killed meanwhile never sees the reply."""
        if outcome == "after":
            raise Crash("request landed after its process died")

    def put_object(self, Bucket: str, Key: str, Body: Any, **kw: Any) -> dict:  # noqa: N803
        outcome = self._pass("put_object", Key, True)
        data = bytes(Body)
        self._check(Key, kw, "PutObject")
        etag = self.b.put(Key, data)
        self._reply(outcome)
        if outcome == "lost":  # the client retries: a conditional PUT fails on its own write
            self._check(Key, kw, "PutObject")
        return {"ETag": etag}

    def _check(self, key: str, kw: dict, op: str) -> None:
        cur = self.b.objects.get(key)
        if kw.get("IfNoneMatch") == "*" and cur is not None:
            raise _error("PreconditionFailed", 412, op)
        if "IfMatch" in kw and (cur is None or cur[1] != kw["IfMatch"]):
            raise _error("PreconditionFailed", 412, op)

    def get_object(
        self,
        Bucket: str,
        Key: str,
        Range: str | None = None,
        IfMatch: str | None = None,  # noqa: N803
    ) -> dict:
        self._pass("get_object", Key, False)
        cur = self.b.objects.get(Key)
        if cur is None:
            raise _error("NoSuchKey", 404, "GetObject")
        data, etag = cur
        if IfMatch is not None and IfMatch != etag:
            raise _error("PreconditionFailed", 412, "GetObject")
        out: dict[str, Any] = {"ETag": etag}
        if Range is not None:
            a, b = (int(x) for x in Range.removeprefix("bytes=").split("-"))
            if a >= len(data):
                raise _error("InvalidRange", 416, "GetObject")
            out["ContentRange"] = f"bytes {a}-{min(b, len(data) - 1)}/{len(data)}"
            data = data[a : b + 1]
        out["ContentLength"] = len(data)
        out["Body"] = io.BytesIO(data)
        return out

    def head_object(self, Bucket: str, Key: str) -> dict:  # noqa: N803
        self._pass("head_object", Key, False)
        cur = self.b.objects.get(Key)
        if cur is None:
            raise _error("404", 404, "HeadObject")
        return {"ContentLength": len(cur[0]), "ETag": cur[1]}

    def list_objects_v2(self, Bucket: str, Prefix: str = "", **kw: Any) -> dict:  # noqa: N803
        self._pass("list_objects_v2", Prefix, False)
        delim = kw.get("Delimiter")
        after = kw.get("ContinuationToken") or kw.get("StartAfter") or ""
        keys, prefixes = [], set()
        for k in self.b.keys_from(Prefix, after):
            rest = k[len(Prefix) :]
            if delim and delim in rest:
                prefixes.add(Prefix + rest.split(delim, 1)[0] + delim)
                continue
            keys.append(k)
        page = keys[: int(kw.get("MaxKeys", PAGE))]
        out: dict[str, Any] = {
            "Contents": [{"Key": k, "Size": len(self.b.objects[k][0])} for k in page],
            "IsTruncated": len(page) < len(keys),
            "KeyCount": len(page),
        }
        if delim:
            out["CommonPrefixes"] = [{"Prefix": p} for p in sorted(prefixes)]
        if out["IsTruncated"]:
            out["NextContinuationToken"] = page[-1]
        return out

    def get_paginator(self, name: str) -> Paginator:
        return Paginator(self, name)

    def delete_object(self, Bucket: str, Key: str) -> dict:  # noqa: N803
        outcome = self._pass("delete_object", Key, True)
        self.b.delete(Key)
        self._reply(outcome)
        return {}

    def delete_objects(self, Bucket: str, Delete: dict) -> dict:  # noqa: N803
        keys = [o["Key"] for o in Delete["Objects"]]
        outcome = self._pass("delete_objects", keys[0] if keys else "", True)
        for k in keys:
            self.b.delete(k)
        self._reply(outcome)
        return {"Errors": []}

    def copy_object(self, Bucket: str, Key: str, CopySource: dict, **kw: Any) -> dict:  # noqa: N803
        outcome = self._pass("copy_object", Key, True)
        src = self.b.objects.get(CopySource["Key"])
        if src is None:
            raise _error("NoSuchKey", 404, "CopyObject")
        etag = self.b.put(Key, src[0])
        self._reply(outcome)
        return {"CopyObjectResult": {"ETag": etag}}

    # ---- multipart -------------------------------------------------------------------------
    def create_multipart_upload(self, Bucket: str, Key: str, **kw: Any) -> dict:  # noqa: N803
        self._pass("create_multipart_upload", Key, True)
        return {"UploadId": self.b.new_upload(Key)}

    def _upload(self, uid: str, op: str) -> tuple[str, dict[int, bytes]]:
        if uid not in self.b.uploads:
            raise _error("NoSuchUpload", 404, op)
        return self.b.uploads[uid]

    def upload_part(self, Bucket: str, Key: str, UploadId: str, PartNumber: int, Body: Any) -> dict:  # noqa: N803
        self._pass("upload_part", Key, True)
        data = bytes(Body)
        self._upload(UploadId, "UploadPart")[1][PartNumber] = data
        return {"ETag": '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"'}

    def upload_part_copy(self, Bucket: str, Key: str, UploadId: str, PartNumber: int,  # noqa: N803
                         CopySource: dict, CopySourceRange: str = "", **kw: Any) -> dict:  # fmt: skip
        self._pass("upload_part_copy", Key, True)
        src = self.b.objects.get(CopySource["Key"])
        if src is None:
            raise _error("NoSuchKey", 404, "UploadPartCopy")
        data = src[0]
        if CopySourceRange:
            a, b = (int(x) for x in CopySourceRange.removeprefix("bytes=").split("-"))
            data = data[a : b + 1]
        self._upload(UploadId, "UploadPartCopy")[1][PartNumber] = data
        etag = '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"'
        return {"CopyPartResult": {"ETag": etag}}

    def complete_multipart_upload(self, Bucket: str, Key: str, UploadId: str, **kw: Any) -> dict:  # noqa: N803
        outcome = self._pass("complete_multipart_upload", Key, True)
        key, parts = self._upload(UploadId, "CompleteMultipartUpload")
        self._check(Key, kw, "CompleteMultipartUpload")
        numbers = [p["PartNumber"] for p in kw["MultipartUpload"]["Parts"]]
        etag = self.b.put(key, b"".join(parts[n] for n in numbers))
        del self.b.uploads[UploadId]
        self._reply(outcome)
        if outcome == "lost":  # the retry finds the upload gone
            raise _error("NoSuchUpload", 404, "CompleteMultipartUpload")
        return {"ETag": etag}

    def abort_multipart_upload(self, Bucket: str, Key: str, UploadId: str) -> dict:  # noqa: N803
        outcome = self._pass("abort_multipart_upload", Key, True)
        self.b.uploads.pop(UploadId, None)
        self._reply(outcome)
        return {}

    def list_multipart_uploads(self, Bucket: str, Prefix: str = "", **kw: Any) -> dict:  # noqa: N803
        self._pass("list_multipart_uploads", Prefix, False)
        marker = (kw.get("KeyMarker", ""), kw.get("UploadIdMarker", ""))
        ups = sorted(
            (key, uid)
            for uid, (key, _) in self.b.uploads.items()
            if key.startswith(Prefix) and (key, uid) > marker
        )
        page = ups[: int(kw.get("MaxUploads", PAGE))]
        out: dict[str, Any] = {
            "Uploads": [{"Key": k, "UploadId": u} for k, u in page],
            "IsTruncated": len(page) < len(ups),
        }
        if out["IsTruncated"]:
            out["NextKeyMarker"], out["NextUploadIdMarker"] = page[-1]
        return out


class Paginator:
    """botocore's paginators for the two listings S3Storage pages through."""

    def __init__(self, client: Client, name: str) -> None:
        self._call = getattr(client, name)
        self._tokens = {
            "list_objects_v2": {"NextContinuationToken": "ContinuationToken"},
            "list_multipart_uploads": {
                "NextKeyMarker": "KeyMarker",
                "NextUploadIdMarker": "UploadIdMarker",
            },
        }[name]

    def paginate(self, **kw: Any) -> Iterator[dict]:
        kw.pop("PaginationConfig", None)
        while True:
            page = self._call(**kw)
            yield page
            if not page.get("IsTruncated"):
                return
            kw.update({arg: page[out] for out, arg in self._tokens.items()})
