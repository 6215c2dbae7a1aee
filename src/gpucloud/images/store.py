"""The node's content-addressed image store and its index of references.

Layout under the state directory (``<state-dir>/images``)::

    blobs/sha256/<hex>        manifests, configs and layer blobs, each named by its digest
    index.json                reference -> manifest digest (+ config digest, for listing)
    tmp/                      partial downloads and unpacks; renamed into place when whole
    locks/<hex>.lock          one lock file per digest being fetched or unpacked

A blob appears under its name only once its content has been verified, by an atomic
rename, so a reader never sees a partial blob. Concurrent pulls of the same layer (threads
or agent processes) serialize on the digest's ``flock``: the second finds the blob present
and does not download it again. Layers are shared by every image and pod on the node.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

from gpucloud.core.filelock import file_lock
from gpucloud.images.errors import DigestMismatch, ImageNotFound
from gpucloud.images.reference import is_digest


def digest_hex(digest: str) -> str:
    """The hex part of a ``sha256:`` digest, validated (it becomes a file name)."""
    if not is_digest(digest):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return digest.split(":", 1)[1]


class BlobStore:
    """Blobs by digest, written atomically and verified before they become visible."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp = root / "tmp"
        for path in (root / "blobs" / "sha256", self.tmp, root / "locks"):
            path.mkdir(parents=True, exist_ok=True)

    def discard(self, digest: str) -> None:
        """Drop a blob found to be damaged, so that the next pull fetches it again."""
        with self.lock(digest):
            self.path(digest).unlink(missing_ok=True)

    def path(self, digest: str) -> Path:
        """Where the blob with ``digest`` lives (whether or not it is there)."""
        return self.root / "blobs" / "sha256" / digest_hex(digest)

    def has(self, digest: str) -> bool:
        """True when the blob is present (and so was verified when it was stored)."""
        return self.path(digest).is_file()

    def read(self, digest: str) -> bytes:
        """A small blob's bytes (manifests, configs); ``ImageNotFound`` when absent."""
        try:
            return self.path(digest).read_bytes()
        except FileNotFoundError as exc:
            raise ImageNotFound(f"blob {digest} is not in the local image store") from exc

    @contextmanager
    def lock(self, digest: str, purpose: str = "blob") -> Iterator[None]:
        """Hold the per-digest lock for ``purpose`` (fetching a blob, unpacking a layer)."""
        with file_lock(self.root / "locks" / f"{purpose}-{digest_hex(digest)}.lock"):
            yield

    def put_bytes(self, digest: str, data: bytes) -> None:
        """Store ``data`` under ``digest`` after checking that it hashes to it."""
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise DigestMismatch(digest, f"its content hashed to {actual}")
        if self.has(digest):
            return
        self.ingest(digest, lambda sink: sink.write(data))

    def ingest(
        self, digest: str, write: Callable[[BinaryIO], object], durable: bool = True
    ) -> bool:
        """Store the blob that ``write`` produces, unless present; True when it was fetched.

        ``write`` must verify what it writes (the registry client does, while streaming);
        it runs under the digest's lock into a temporary file that is renamed when whole.
        ``durable=False`` skips the fsync: layers use it, because fsync halves the pull
        rate and a layer a crash left truncated is caught (and dropped) when it is
        unpacked, by its ``diff_id``; manifests and configs are always synced.
        """
        with self.lock(digest):
            if self.has(digest):
                return False
            fd, name = tempfile.mkstemp(dir=self.tmp, prefix="blob-")
            try:
                with os.fdopen(fd, "wb") as sink:
                    write(sink)
                    sink.flush()
                    if durable:
                        os.fsync(sink.fileno())
                os.chmod(name, 0o644)
                os.replace(name, self.path(digest))
            except BaseException:
                Path(name).unlink(missing_ok=True)
                raise
            return True

    def add_stream(self, source: IO[bytes]) -> tuple[str, int]:
        """Store a blob of not yet known digest from ``source``; return (digest, size)."""
        hasher = hashlib.sha256()
        size = 0
        fd, name = tempfile.mkstemp(dir=self.tmp, prefix="import-")
        try:
            with os.fdopen(fd, "wb") as sink:
                while chunk := source.read(1 << 20):
                    hasher.update(chunk)
                    sink.write(chunk)
                    size += len(chunk)
                sink.flush()
                os.fsync(sink.fileno())
            digest = "sha256:" + hasher.hexdigest()
            with self.lock(digest):
                if not self.has(digest):
                    os.chmod(name, 0o644)
                    os.replace(name, self.path(digest))
        finally:
            Path(name).unlink(missing_ok=True)
        return digest, size

    def copy_in(self, digest: str, source: IO[bytes]) -> None:
        """Store a blob read from ``source``, hashing it on the way (imports)."""

        def write(sink: BinaryIO) -> None:
            hasher = hashlib.sha256()
            while chunk := source.read(1 << 20):
                hasher.update(chunk)
                sink.write(chunk)
            actual = "sha256:" + hasher.hexdigest()
            if actual != digest:
                raise DigestMismatch(digest, f"its content hashed to {actual}")

        self.ingest(digest, write)


@dataclass(frozen=True)
class ImageRecord:
    """One entry of the image index."""

    reference: str
    manifest_digest: str
    config_digest: str
    size: int
    created_at: float


class ImageIndex:
    """``reference -> manifest`` as a JSON file, replaced atomically under a lock."""

    def __init__(self, root: Path) -> None:
        self._path = root / "index.json"
        self._lock_path = root / "locks" / "index.lock"

    def get(self, reference: str) -> ImageRecord | None:
        """The record for ``reference`` (canonical form), if stored."""
        return self._load().get(reference)

    def all(self) -> list[ImageRecord]:
        """Every record, sorted by reference."""
        return sorted(self._load().values(), key=lambda r: r.reference)

    def put(self, reference: str, manifest_digest: str, config_digest: str, size: int) -> None:
        """Point ``reference`` at a manifest (replacing what it pointed at)."""
        record = ImageRecord(reference, manifest_digest, config_digest, size, time.time())
        with file_lock(self._lock_path):
            records = self._load()
            records[reference] = record
            self._save(records)

    def remove(self, reference: str) -> bool:
        """Forget ``reference``; True when it was there. Blobs stay (shared, cached)."""
        with file_lock(self._lock_path):
            records = self._load()
            found = records.pop(reference, None) is not None
            self._save(records)
        return found

    def _load(self) -> dict[str, ImageRecord]:
        try:
            raw = json.loads(self._path.read_text())
        except FileNotFoundError:
            return {}
        return {ref: ImageRecord(reference=ref, **fields) for ref, fields in raw.items()}

    def _save(self, records: dict[str, ImageRecord]) -> None:
        data = {
            ref: {
                "manifest_digest": r.manifest_digest,
                "config_digest": r.config_digest,
                "size": r.size,
                "created_at": r.created_at,
            }
            for ref, r in sorted(records.items())
        }
        tmp = self._path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, self._path)


def remove_tree(path: Path) -> None:
    """Remove a directory tree if present (used for stale temporary unpacks)."""
    if path.exists():
        shutil.rmtree(path)
