"""S3 failures as errors that name the object, the cause and what to do (credentials never
appear), and the bound on how long one request can block (for the lease's TTL)."""

from __future__ import annotations

import errno
import re
from typing import Any

from ..errors import CheckpointCorruptError
from .base import PreconditionFailedError, StorageError

# botocore's backoff before retry n (1-based) is at most min(2 ** (n - 1), 20) s, plus up to 5 s
# more when the server sends x-amz-retry-after.
_BACKOFF_MAX_S, _RETRY_AFTER_MAX_S = 20.0, 5.0
_CONTENT_RANGE = re.compile(r"bytes \d+-\d+/(\d+)")


def call_bound_s(opts: dict[str, Any]) -> float:
    """The longest one S3 request with a small body and reply (the lease, a manifest, a
    marker, a listing) can block, retries included: a try waits at most `connect_timeout_s`
    to connect and `read_timeout_s` for each read or write on the connection, and botocore's
    backoff between tries is capped. A large body is bounded per read or write, not in all."""
    tries = max(int(opts["max_attempts"]), 1)
    per_try = float(opts["connect_timeout_s"]) + float(opts["read_timeout_s"])
    backoff = sum(min(2.0**n, _BACKOFF_MAX_S) + _RETRY_AFTER_MAX_S for n in range(tries - 1))
    return tries * per_try + backoff


def translate(e: Exception, what: str, where: str, opts: dict[str, Any]) -> Exception:
    """A clear error naming the object and what to do; credentials never appear."""
    from botocore import exceptions as bx

    endpoint = opts.get("endpoint_url")
    at = f" at {endpoint}" if endpoint else ""
    if isinstance(e, bx.ClientError):
        return _reply_error(e, what, where, at)
    if isinstance(e, bx.NoCredentialsError):
        return StorageError(errno.EACCES, f"{where}: no S3 credentials found: set AWS_* or options")
    if isinstance(e, (bx.ReadTimeoutError, bx.ConnectTimeoutError)):
        name = "read_timeout_s" if isinstance(e, bx.ReadTimeoutError) else "connect_timeout_s"
        return StorageError(
            errno.ETIMEDOUT,
            f"{where}: {what} timed out: the S3 endpoint{at} did not answer within {name}="
            f"{opts[name]} s, max_attempts={opts['max_attempts']} tries (at most "
            f"{call_bound_s(opts):.0f} s in all); check the endpoint, or raise storage_options "
            f"{name} for a slow one (and lease_ttl_s above the bound)",
        )
    if isinstance(e, bx.EndpointConnectionError) or "Connect" in type(e).__name__:
        return StorageError(
            errno.EHOSTUNREACH, f"{where}: cannot reach the S3 endpoint{at} ({type(e).__name__})"
        )
    if isinstance(e, (OSError, CheckpointCorruptError)):
        return e
    return StorageError(errno.EIO, f"{where}: {what} failed: {type(e).__name__}: {e}")


def _reply_error(e: Any, what: str, where: str, at: str) -> Exception:
    """The error for a reply of the server (botocore's ClientError)."""
    code = str(e.response.get("Error", {}).get("Code", ""))
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in ("NoSuchKey", "NoSuchUpload", "404", "NotFound"):
        return FileNotFoundError(errno.ENOENT, f"{where} does not exist")
    if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
        return PreconditionFailedError(errno.ESTALE, f"{where}: {what} refused: {code}")
    if code == "NoSuchBucket":
        return StorageError(
            errno.ENOENT, f"{where}: the bucket does not exist{at}; create it first"
        )
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"):
        return StorageError(
            errno.EACCES,
            f"{where}: {what} refused ({code}){at}: check the credentials "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or storage_options) and permissions",
        )
    return StorageError(errno.EIO, f"{where}: {what} failed after retries: {code} ({status})")


def reply_size(reply: dict[str, Any], where: str) -> int | None:
    """The object's size from a ranged GET's Content-Range (absent if the Range was ignored)."""
    content_range = reply.get("ContentRange")
    if not content_range:
        return None
    m = _CONTENT_RANGE.fullmatch(str(content_range))
    if m is None:  # e.g. a reply cut off inside its head
        raise StorageError(errno.EIO, f"{where}: read failed: malformed reply (Content-Range "
                           f"{content_range!r}); the connection to the S3 endpoint broke?")  # fmt: skip
    return int(m.group(1))
