"""Wire types of checkpoints: manifests, the agent's upload protocol, what users read back.

A checkpoint is a directory snapshot: every regular file split into chunks addressed by
their SHA-256 (``CHUNK_BYTES`` each, the last one shorter), plus directories and symlinks.
The manifest lists them and is committed last, so a checkpoint whose chunks are not all
in the store is never visible. Manifests are named by the writer's attempt and a sequence
number the server assigns (``<attempt>-<seq>``).
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import PurePosixPath
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from gpucloud.core.spec import _Request

#: The chunk size agents split files into (the server accepts up to ``MAX_CHUNK_BYTES``).
CHUNK_BYTES = 4 * 1024 * 1024
MAX_CHUNK_BYTES = 16 * 1024 * 1024
MAX_FILES = 100_000
MAX_DIGESTS = 1_000_000
#: What the program writes to ask for an upload, and what the agent answers with.
DONE_MARKER = ".done"
COMMITTED_MARKER = ".committed"
FAILED_MARKER = ".failed"
MARKERS = frozenset({DONE_MARKER, COMMITTED_MARKER, FAILED_MARKER})
DIGEST = re.compile(r"^[0-9a-f]{64}$")
#: Where the agent ships ``gpucloud-ckpt`` in every container, and the variables it sets.
CKPT_TOOL_PATH = "/run/gpucloud/bin/gpucloud-ckpt"
ENV_CHECKPOINT_DIR = "GPUCLOUD_CHECKPOINT_DIR"
DEFAULT_RETENTION = 2


def check_digest(value: str) -> str:
    if not DIGEST.match(value):
        raise ValueError(f"{value[:80]!r} is not a SHA-256 digest (64 lower-case hex digits)")
    return value


def check_relative_path(value: str) -> str:
    """A path inside the checkpoint directory: relative, normalized, no ``..``."""
    path = PurePosixPath(value)
    if (not value or value.startswith("/") or ".." in path.parts or "\x00" in value
            or str(path) != value or value == "."):
        raise ValueError(f"{value[:200]!r} is not a normalized relative path")
    return value


class ManifestEntry(BaseModel):
    """One file, directory or symlink of the snapshot."""

    path: str = Field(max_length=4096)
    kind: Literal["file", "dir", "symlink"]
    mode: int = Field(default=0o644, ge=0, le=0o7777)
    size: int = Field(default=0, ge=0)
    #: The file's chunks in order (digests); a chunk may recur.
    chunks: list[str] = Field(default_factory=list)
    target: str | None = Field(default=None, max_length=4096)

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return check_relative_path(value)

    @field_validator("chunks")
    @classmethod
    def _chunks(cls, value: list[str]) -> list[str]:
        for digest in value:
            check_digest(digest)
        return value


class Manifest(BaseModel):
    """A checkpoint's table of contents; ``attempt`` and ``seq`` are set by the server."""

    version: int = 1
    chunk_bytes: int = Field(default=CHUNK_BYTES, gt=0, le=MAX_CHUNK_BYTES)
    entries: list[ManifestEntry] = Field(default_factory=list, max_length=MAX_FILES)
    key: str | None = None
    attempt: int | None = None
    seq: int | None = None

    @property
    def size_bytes(self) -> int:
        return sum(entry.size for entry in self.entries)

    def digests(self) -> set[str]:
        return {digest for entry in self.entries for digest in entry.chunks}


class CheckpointMissingRequest(_Request):
    """The agent's first step: which of these chunks does the store lack? Opens an upload
    (its chunks are never collected while it lasts)."""

    fencing_token: int
    attempt: int
    digests: list[str] = Field(max_length=MAX_DIGESTS)

    @field_validator("digests")
    @classmethod
    def _digests(cls, value: list[str]) -> list[str]:
        for digest in value:
            check_digest(digest)
        return value


class CheckpointMissingOut(BaseModel):
    upload_id: str
    missing: list[str]


class ChunkUploadOut(BaseModel):
    """Where an upload of one chunk stands: bytes received so far; ``complete`` once the
    whole chunk is stored (its digest checked)."""

    digest: str
    received: int
    complete: bool


class CheckpointCommitRequest(_Request):
    """The agent's last step: publish the manifest (every chunk must be in the store)."""

    fencing_token: int
    attempt: int
    upload_id: str = Field(max_length=32)
    manifest: Manifest
    #: δ: seconds from the commit marker to this request (the server adds its own part).
    cost_seconds: float = Field(default=0.0, ge=0, le=10 * 86400)
    bytes_sent: int = Field(default=0, ge=0)


class CheckpointRejectRequest(_Request):
    """A restore refused this checkpoint (a chunk's digest did not match, or one was
    missing): it is marked corrupt and never offered again."""

    fencing_token: int
    attempt: int
    reason: str = Field(max_length=1000)


class CheckpointOut(BaseModel):
    id: str
    project: str
    key: str
    pod: str | None = None
    pod_id: str | None = None
    node: str | None = None
    attempt: int
    seq: int
    state: str
    size_bytes: int
    files: int
    chunks: int
    bytes_sent: int
    cost_seconds: float | None = None
    created_at: datetime


class CheckpointSummary(BaseModel):
    """A pod's latest committed checkpoint, as ``pod get`` shows it."""

    id: str
    time: datetime
    size_bytes: int


class CheckpointDetailOut(CheckpointOut):
    """``checkpoint get``: the row and its manifest."""

    manifest: Manifest


class AgentCheckpointRequest(_Request):
    """A fenced agent call that carries nothing else (``restored``)."""

    fencing_token: int
    attempt: int
