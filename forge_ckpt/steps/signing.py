"""Signed checkpoints: an HMAC-SHA256 of the manifest, in the commit marker.

A CRC32C catches accidents, not someone who can write the folder (a matching CRC is easy to
forge, and they can rewrite the manifest and marker too). With a signing key configured, every
file's cryptographic digest (BLAKE3 by default) goes into the manifest, the manifest is signed
with HMAC-SHA256 and the signature goes into COMMIT; loading checks the signature with any of the
accepted verification keys (key rotation), then every file against its digest. Without the key
nobody can produce a step that loads.

Keys come from `CheckpointConfig(signing_key=..., verify_keys=[...])` or the environment
(`FORGE_CKPT_SIGNING_KEY`, `FORGE_CKPT_VERIFY_KEYS` comma-separated); they are never written
anywhere: the marker names a key only by a short fingerprint (8 hex digits of SHA-256 of the key).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import CheckpointSignatureError

SCHEME = "hmac-sha256"


def _bytes(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


def key_id(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()[:8]


@dataclass(frozen=True)
class Signer:
    """Signs with `signing_key` (if any); accepts signatures by it or any `verify_keys`."""

    signing_key: bytes | None = field(default=None, repr=False)
    verify_keys: tuple[bytes, ...] = field(default=(), repr=False)
    allow_unsigned: bool = False

    @classmethod
    def from_config(
        cls,
        signing_key: str | bytes | None = None,
        verify_keys: Sequence[str | bytes] = (),
        allow_unsigned: bool = False,
    ) -> Signer:
        """Explicit keys, else the environment's."""
        key = signing_key if signing_key is not None else os.environ.get("FORGE_CKPT_SIGNING_KEY")
        extra = list(verify_keys) or [
            k for k in os.environ.get("FORGE_CKPT_VERIFY_KEYS", "").split(",") if k
        ]
        return cls(
            signing_key=_bytes(key) if key else None,
            verify_keys=tuple(_bytes(k) for k in extra),
            allow_unsigned=allow_unsigned,
        )

    @property
    def active(self) -> bool:
        """A key is configured: steps must be signed (unless allow_unsigned)."""
        return self.signing_key is not None or bool(self.verify_keys)

    def sign(self, manifest: bytes) -> str | None:
        if self.signing_key is None:
            return None
        mac = hmac.new(self.signing_key, manifest, hashlib.sha256).hexdigest()
        return f"{SCHEME}:{key_id(self.signing_key)}:{mac}"

    def check(self, manifest: bytes, signature: str | None, where: str) -> None:
        """Raise CheckpointSignatureError unless the signature is valid (or not required)."""
        if not self.active:
            if signature is not None:
                raise CheckpointSignatureError(
                    f"{where}: the step is signed (key {signature.split(':')[1]}) but no key is "
                    "configured to check it: set verify_keys or FORGE_CKPT_VERIFY_KEYS "
                    "(FORGE_CKPT_SIGNING_KEY also verifies)"
                )
            return
        if signature is None:
            if self.allow_unsigned:
                return
            raise CheckpointSignatureError(
                f"{where}: the step is not signed, and a signing key is configured; load it "
                "with allow_unsigned=True if you trust it (steps older than the first signed "
                "one only), or re-save it signed"
            )
        self._check_mac(manifest, signature, where)

    def check_unsigned_order(self, step: int, signed_before: int | None, where: str) -> None:
        """`allow_unsigned` admits an unsigned step only if no signed step is older: a run
        that signs keeps signing, so an unsigned step after a signed one was planted (or saved
        without the key) and must never become the step a job resumes."""
        if signed_before is None:
            return
        raise CheckpointSignatureError(
            f"{where}: step {step} is not signed, but step {signed_before}, older, is. "
            "allow_unsigned=True admits only steps older than the first signed step (those "
            "saved before signing was turned on); an unsigned step after a signed one was saved "
            "without the key or planted by someone who can write the folder. If you did not "
            f"save it unsigned, move step-{step} out of the folder; else load a signed step "
            "with load(step=...)"
        )

    def _check_mac(self, manifest: bytes, signature: str, where: str) -> None:
        scheme, _, rest = signature.partition(":")
        kid, _, mac = rest.partition(":")
        keys = [k for k in (self.signing_key, *self.verify_keys) if k is not None]
        if scheme != SCHEME or not mac:
            raise CheckpointSignatureError(f"{where}: unknown signature scheme {scheme!r}")
        for key in keys:
            want = hmac.new(key, manifest, hashlib.sha256).hexdigest()
            if hmac.compare_digest(want, mac):
                return
        known = ", ".join(key_id(k) for k in keys)
        raise CheckpointSignatureError(
            f"{where}: signature does not match (signed with key {kid}; accepted keys: {known}): "
            "the manifest was altered, or it was signed with a key this job does not accept; "
            "add the signing key to verify_keys (FORGE_CKPT_VERIFY_KEYS) if the step is yours"
        )
