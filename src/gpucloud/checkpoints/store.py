"""Store backends (the protocol, the embedded disk store) and the upload staging area.

Layout under the store's root (a directory, or ``s3://bucket/prefix``), one tree per
project so that nothing of one project is ever reachable through another's names::

    <project id>/chunks/<digest>              one chunk, named by its SHA-256
    <project id>/manifests/<key>/<name>.json  one committed manifest (exclusive create)
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Protocol

from gpucloud.core.errors import GpucloudError, InvalidInput, NotFound


class StoreError(GpucloudError):
    """The store could not do what was asked (its message says why)."""


class ManifestExists(StoreError):
    """A manifest of that name was committed already (the exclusive create lost)."""


class ChunkStore(Protocol):
    """What the checkpoint service needs of a backend."""

    def missing(self, project: str, digests: Iterable[str]) -> list[str]: ...

    def put_chunk(self, project: str, digest: str, source: Path) -> None: ...

    def get_chunk(self, project: str, digest: str) -> bytes: ...

    def list_chunks(self, project: str) -> set[str]: ...

    def delete_chunk(self, project: str, digest: str) -> None: ...

    def put_manifest(self, project: str, name: str, data: bytes) -> None: ...

    def get_manifest(self, project: str, name: str) -> bytes: ...

    def delete_manifest(self, project: str, name: str) -> None: ...

    def abort_incomplete(self, older_than: datetime) -> int: ...


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while block := source.read(1024 * 1024):
            digest.update(block)
    return digest.hexdigest()


class DiskStore:
    """The embedded store: files under ``root``; publishing is rename/link, so readers
    see a chunk or manifest whole or not at all."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _chunk(self, project: str, digest: str) -> Path:
        return self.root / project / "chunks" / digest[:2] / digest

    def _manifest(self, project: str, name: str) -> Path:
        return self.root / project / "manifests" / f"{name}.json"

    def missing(self, project: str, digests: Iterable[str]) -> list[str]:
        return sorted({d for d in digests if not self._chunk(project, d).is_file()})

    def put_chunk(self, project: str, digest: str, source: Path) -> None:
        target = self._chunk(project, digest)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, target)

    def get_chunk(self, project: str, digest: str) -> bytes:
        try:
            return self._chunk(project, digest).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"chunk {digest} is not in the store") from None

    def list_chunks(self, project: str) -> set[str]:
        base = self.root / project / "chunks"
        return {path.name for path in base.glob("*/*")} if base.is_dir() else set()

    def delete_chunk(self, project: str, digest: str) -> None:
        self._chunk(project, digest).unlink(missing_ok=True)

    def put_manifest(self, project: str, name: str, data: bytes) -> None:
        """Exclusive create: a temporary file hard-linked to the name (fails if taken)."""
        target = self._manifest(project, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.{os.getpid()}.{time.monotonic_ns()}")
        temporary.write_bytes(data)
        try:
            os.link(temporary, target)
        except FileExistsError:
            raise ManifestExists(f"manifest {name} exists already") from None
        finally:
            temporary.unlink(missing_ok=True)

    def get_manifest(self, project: str, name: str) -> bytes:
        try:
            return self._manifest(project, name).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"manifest {name} is not in the store") from None

    def delete_manifest(self, project: str, name: str) -> None:
        self._manifest(project, name).unlink(missing_ok=True)

    def abort_incomplete(self, older_than: datetime) -> int:
        """Nothing to abort on disk: partial chunks live in ``Staging``."""
        del older_than
        return 0


class Staging:
    """Partial chunk uploads on the server's disk: ``<root>/<project>/<digest>.part``.

    A piece is appended only at the current end (``Content-Range`` start = bytes held),
    so an interrupted upload resumes exactly where it stopped; the completed chunk's
    SHA-256 must equal its name, or it is discarded (422) and nothing is stored.
    """

    #: Lock stripes: a chunk's uploads serialize on one of these files (a bounded set,
    #: never deleted, since removing a lock file others wait on breaks the lock).
    LOCK_STRIPES = 1024

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, project: str, digest: str) -> Path:
        return self.root / project / f"{digest}.part"

    @cached_property
    def _lock_folder(self) -> Path:
        """Made on the first lock, once (two threads at once both ``mkdir``: harmless)."""
        folder = self.root / ".locks"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    @contextmanager
    def locked(self, digest: str) -> Iterator[None]:
        """Hold the chunk's upload lock: the bytes held, the append and the finish of
        two senders of one chunk (a retry while the first request is still served, two
        ranks with the same bytes, two server processes) never interleave. ``flock``, so
        threads and processes on this host alike."""
        stripe = int(digest[-8:], 16) % self.LOCK_STRIPES if digest else 0
        with open(self._lock_folder / f"{stripe:04d}", "a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def received(self, project: str, digest: str) -> int:
        try:
            return self.path(project, digest).stat().st_size
        except FileNotFoundError:
            return 0

    def append(self, project: str, digest: str, start: int, data: bytes) -> int:
        """Append ``data`` at ``start``; returns the bytes held afterwards. A start past
        the end is refused; one before it (a resent piece) is trimmed to what is new."""
        path = self.path(project, digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        held = self.received(project, digest)
        if start > held:
            raise InvalidInput("Content-Range", f"starts at {start}; the server holds {held} "
                               "bytes of this chunk: resume from there")
        new = data[held - start:]
        with path.open("ab") as out:
            out.write(new)
        return held + len(new)

    def finish(self, project: str, digest: str) -> Path:
        """The complete chunk, its digest checked; a mismatch discards it."""
        path = self.path(project, digest)
        actual = sha256_file(path)
        if actual != digest:
            path.unlink(missing_ok=True)
            raise InvalidInput("digest", f"the uploaded chunk's SHA-256 is {actual}, not "
                               f"{digest}; it was discarded")
        return path

    def discard_older(self, older_than: float) -> int:
        """Drop partial uploads untouched since ``older_than`` (a ``time.time()``)."""
        dropped = 0
        for part in self.root.glob("*/*.part") if self.root.is_dir() else ():
            if part.stat().st_mtime < older_than:
                part.unlink(missing_ok=True)
                dropped += 1
        return dropped


def parse_store_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` → (bucket, prefix without slashes at the ends)."""
    if not url.startswith("s3://"):
        raise StoreError(f"GPUCLOUD_CHECKPOINT_STORE={url!r}: expected s3://bucket/prefix "
                         "(or unset for the embedded store)")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not bucket:
        raise StoreError(f"GPUCLOUD_CHECKPOINT_STORE={url!r} names no bucket")
    return bucket, prefix.strip("/")
