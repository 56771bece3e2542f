"""The lease object's bytes: its fields sealed by a CRC32C, and its commit record (which
step was committed by which lease generation). Read by layout.py (which markers count) and
written by lock.py (who holds the folder); one damaged byte reads as a damaged lease."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointLeaseCorruptError
from ..storage import crc32c_of_bytes

# The fields of the lease as first written (2026-11-23, before the commit record and the
# checksum existed; every such lease has all of them). A lease without `crc32c` must be
# exactly that: any other field (a commit record, or the checksum's own key with a damaged
# byte) or a missing one means damage, never "a lease of an earlier version".
UNSEALED_FIELDS = frozenset(
    {"owner", "host", "pid", "pid_start", "started", "renewed", "expires", "generation",
     "released"}
)  # fmt: skip


def seal_lease(body: Mapping[str, Any]) -> bytes:
    """The lease object's bytes: its fields, then the CRC32C of their JSON (one damaged byte
    must read as a damaged lease, never as another holder, an expiry or a record)."""
    text = json.dumps(dict(body))
    return json.dumps({**body, "crc32c": crc32c_of_bytes(text.encode())}).encode()


def parse_lease(data: bytes | bytearray, where: str) -> dict[str, Any]:
    """A lease object's fields; CheckpointLeaseCorruptError if it does not parse, its CRC32C
    does not match, it has none but is not a lease of the version before checksums
    (`UNSEALED_FIELDS`: a damaged key must not switch the check off), or its record is
    malformed."""
    try:
        lease = json.loads(data)
    except ValueError as e:
        raise CheckpointLeaseCorruptError(where, f"not JSON: {e}") from None
    if not isinstance(lease, dict):
        raise CheckpointLeaseCorruptError(where, "not a JSON object")
    crc = lease.pop("crc32c", None)
    if crc is None and set(lease) != UNSEALED_FIELDS:
        extra, missing = sorted(set(lease) - UNSEALED_FIELDS), sorted(UNSEALED_FIELDS - set(lease))
        raise CheckpointLeaseCorruptError(
            where,
            "it has no checksum, and is not a lease of the version before checksums "
            f"(fields it should not have: {', '.join(extra) or 'none'}; "
            f"missing: {', '.join(missing) or 'none'})",
        )
    if crc is not None and crc != crc32c_of_bytes(json.dumps(lease).encode()):
        raise CheckpointLeaseCorruptError(where, "its checksum does not match its content")
    if "committed" in lease and parse_record(lease) is None:
        raise CheckpointLeaseCorruptError(where, "its commit record is malformed")
    return lease


def parse_record(lease: Mapping[str, Any]) -> dict[int, int | None] | None:
    """The commit record of a parsed lease (step -> generation of its COMMIT, None: any);
    None if the lease has none."""
    record = lease.get("committed")
    if not isinstance(record, dict):
        return None
    try:
        return {int(k): None if v is None else int(v) for k, v in record.items()}
    except (TypeError, ValueError):
        return None
