"""The checkpoint store: content-addressed chunks and manifests, per project.

Backends: ``DiskStore`` (embedded: the server's disk under ``GPUCLOUD_HOME``) and
``S3Store`` (any S3-compatible store through boto3, ``GPUCLOUD_CHECKPOINT_STORE=s3://…``,
endpoint and credentials from the usual AWS variables). Chunk uploads arrive in pieces and
are staged on the server's disk (``Staging``) until the whole chunk is there and its digest
checks out; only then does the backend see it.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from gpucloud.checkpoints.s3 import S3Store
from gpucloud.checkpoints.store import (
    ChunkStore,
    DiskStore,
    ManifestExists,
    Staging,
    StoreError,
    parse_store_url,
)

__all__ = ["ChunkStore", "DiskStore", "ManifestExists", "S3Store", "Staging", "StoreError",
           "open_store", "staging"]


@lru_cache(maxsize=16)
def open_store(home: Path, url: str | None) -> ChunkStore:
    """The configured backend: ``url`` (``s3://bucket/prefix``) or the disk under ``home``."""
    if not url:
        return DiskStore(home / "checkpoints" / "store")
    bucket, prefix = parse_store_url(url)
    return S3Store(bucket, prefix)


@lru_cache(maxsize=16)
def staging(home: Path) -> Staging:
    """The partial uploads under ``home``: one object per home, so that what it sets up
    once (its lock folder) is set up once per process."""
    return Staging(home / "checkpoints" / "uploads")
