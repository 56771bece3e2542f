"""Helpers for tests against the local SeaweedFS S3 server (fixtures `s3_server`, `s3_folder`)."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from apps.seaweed import SeaweedServer


@dataclass(frozen=True)
class S3Folder:
    """A fresh bucket per test; `url` is where a checkpoint folder goes, `options` are boto3's
    client keyword arguments for the server (endpoint and credentials)."""

    url: str
    options: dict[str, str]
    server: SeaweedServer = field(repr=False)
    bucket: str

    @property
    def prefix(self) -> str:
        """The key prefix of `url` inside the bucket ("ckpt")."""
        return self.url.removeprefix(f"s3://{self.bucket}/")


def bucket_name(test_name: str) -> str:
    """A valid, unique S3 bucket name from a test's name: lowercase letters, digits and
    hyphens, 3-63 characters, starting and ending with a letter or digit."""
    base = re.sub(r"[^a-z0-9]+", "-", test_name.lower()).strip("-")[:50].strip("-")
    if not base or base.startswith(("xn--", "sthree")):
        base = f"t-{base}".strip("-")
    return f"{base}-{secrets.token_hex(4)}"


def client(options: dict[str, str], attempts: int = 3, connect_timeout: float = 5.0) -> Any:
    """A boto3 S3 client for `options`: path-style, standard retry mode, `attempts` tries in all
    (botocore's own `max_attempts` counts retries only: 1 there means two tries)."""
    import boto3
    from botocore.config import Config

    config = Config(
        connect_timeout=connect_timeout,
        read_timeout=60,
        retries={"total_max_attempts": attempts, "mode": "standard"},
        s3={"addressing_style": "path"},
    )
    return boto3.client("s3", config=config, **options)


def list_keys(s3: Any, bucket: str, prefix: str = "") -> list[str]:
    """Every key under `prefix`, across pages (S3 returns at most 1,000 per call)."""
    keys: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys.extend(obj["Key"] for obj in page.get("Contents", []))
    return keys
