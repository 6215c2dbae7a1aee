"""The node's chunk cache: uncompressed eStargz chunks by ``chunkDigest``, shared by layers.

A chunk is verified (sha256 of its bytes against the digest it is filed under) before it
is inserted, so one tenant's fetch can never poison another's read; a file appears under
its name only by an atomic rename of a complete temporary file. The cache keeps itself
under ``limit`` bytes by evicting least-recently-used chunks (use is tracked in memory and
seeded from modification times at start). A full disk never corrupts anything: the insert
evicts and tries once more, and if that fails too the chunk is simply not cached (the
reader still gets its verified bytes).

Trust: a chunk file is written only after its bytes hashed to its name, and only by an
atomic rename, so reads from the cache do not hash again (``read`` serves slices of it
with ``os.pread`` on descriptors kept open, ``_FdPool``): the files are root-only and
nothing but this cache writes them. Re-verifying every read would cost a sha256 of 4 MiB
per 128 KiB page-in (cached sequential reads ran at 262 MB/s that way).

Layout: ``<root>/sha256/<hex>`` chunks, ``<root>/tmp/`` partial writes, ``<root>/toc/<hex>``
verified TOCs (by TOC digest) so a restarted daemon can mount without the registry.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from gpucloud.images.store import digest_hex

log = logging.getLogger(__name__)

OPEN_FILES = 256


class CachedFd:
    """One open chunk file; closed when evicted from the pool and no reader uses it."""

    __slots__ = ("fd", "users", "retired")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0
        self.retired = False


class _FdPool:
    """Open read-only descriptors of chunk files, LRU-bounded to ``limit``.

    Reference counts make closing safe: a descriptor dropped from the pool (or of an evicted
    chunk) is closed only once its last ``pread`` is done, so a reused fd number can never
    be read as another chunk."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._open: OrderedDict[str, CachedFd] = OrderedDict()

    def pread(self, digest: str, path: Path, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` of the chunk file (``FileNotFoundError`` if gone)."""
        handle = self.acquire(digest, path)
        try:
            return os.pread(handle.fd, size, offset)
        finally:
            self.release(handle)

    def close(self) -> None:
        """Close every descriptor (once its readers are done)."""
        with self._lock:
            handles = list(self._open.values())
            self._open.clear()
            for handle in handles:
                self._retire(handle)

    def forget(self, digest: str) -> None:
        """The chunk was evicted: close its descriptor once unused."""
        with self._lock:
            handle = self._open.pop(digest, None)
            if handle is not None:
                self._retire(handle)

    def held(self, digest: str) -> CachedFd | None:
        """The open descriptor of ``digest``, its use counted, or None when not open."""
        with self._lock:
            handle = self._open.get(digest)
            if handle is not None:
                self._open.move_to_end(digest)
                handle.users += 1
            return handle

    def acquire(self, digest: str, path: Path) -> CachedFd:
        """The chunk file's descriptor, its use counted (``release`` when done)."""
        handle = self.held(digest)
        if handle is not None:
            return handle
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        with self._lock:
            handle = self._open.get(digest)
            if handle is not None:  # another reader opened it meanwhile
                os.close(fd)
            else:
                handle = self._open[digest] = CachedFd(fd)
                while len(self._open) > self._limit:
                    self._retire(self._open.popitem(last=False)[1])
            handle.users += 1
            return handle

    def release(self, handle: CachedFd) -> None:
        with self._lock:
            handle.users -= 1
            if handle.retired and handle.users == 0:
                os.close(handle.fd)

    def _retire(self, handle: CachedFd) -> None:
        handle.retired = True
        if handle.users == 0:
            os.close(handle.fd)


class ChunkCache:
    """Content-addressed chunk store with an LRU size limit (``limit`` bytes)."""

    def __init__(self, root: Path, limit: int) -> None:
        self.root = root
        self.limit = limit
        self._chunks = root / "sha256"
        self._tmp = root / "tmp"
        self._tocs = root / "toc"
        for path in (self._chunks, self._tmp, self._tocs):
            path.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self._fds = _FdPool(OPEN_FILES)
        self.evictions = 0
        self.insert_failures = 0
        self._scan()

    @property
    def used(self) -> int:
        """Bytes of chunks held now."""
        with self._lock:
            return self._used

    def close(self) -> None:
        """Close the open chunk files (the cache stays usable: they reopen on demand)."""
        self._fds.close()

    def has(self, digest: str) -> bool:
        """True when the chunk is cached."""
        with self._lock:
            return digest in self._lru

    def get(self, digest: str) -> bytes | None:
        """The chunk's bytes (and it becomes most recently used), or None."""
        with self._lock:
            size = self._lru.get(digest)
        return None if size is None else self.read(digest, 0, size)

    def read(self, digest: str, offset: int, size: int) -> bytes | None:
        """``size`` bytes at ``offset`` of a cached chunk (trusted: verified on insert), or
        None when it is not cached; it becomes most recently used."""
        with self._lock:
            if digest not in self._lru:
                return None
            self._lru.move_to_end(digest)
        try:
            return self._fds.pread(digest, self._chunks / digest_hex(digest), offset, size)
        except FileNotFoundError:
            self._drop(digest)
            return None

    def acquire(self, digest: str) -> CachedFd | None:
        """An open descriptor of a cached chunk (it becomes most recently used), held until
        ``release``: it is not closed meanwhile, even if the chunk is evicted. None when the
        chunk is not cached. For zero-copy replies (``fs.LayerFs.read_buf``: libfuse reads
        the file itself, after the callback returns)."""
        with self._lock:
            if digest not in self._lru:
                return None
            self._lru.move_to_end(digest)
        handle = self._fds.held(digest)
        if handle is not None:  # the hot path: no path built, no open
            return handle
        try:
            return self._fds.acquire(digest, self._chunks / digest_hex(digest))
        except FileNotFoundError:
            self._drop(digest)
            return None

    def release(self, handle: CachedFd) -> None:
        """Give back a descriptor from ``acquire``."""
        self._fds.release(handle)

    def _drop(self, digest: str) -> None:
        with self._lock:
            self._used -= self._lru.pop(digest, 0)
        self._fds.forget(digest)

    def put(self, digest: str, data: bytes, *, verified: bool = False) -> bool:
        """Insert a chunk after checking its digest; True when it is now cached.

        ``ValueError`` when ``data`` does not hash to ``digest`` (nothing is written).
        ``verified``: the caller has just hashed ``data`` against ``digest`` itself (the
        layer's ``decode_chunk`` does, before serving a byte), so it is not hashed twice.
        A chunk larger than the whole cache is not cached.
        """
        if not verified:
            actual = "sha256:" + hashlib.sha256(data).hexdigest()
            if actual != digest:
                raise ValueError(f"chunk hashed to {actual}, not {digest}")
        if len(data) > self.limit:
            return False
        if self.has(digest):
            return True
        self._make_room(len(data))
        try:
            self._write(self._chunks / digest_hex(digest), data)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            if not self._evict_one():
                self.insert_failures += 1
                log.warning("chunk cache: disk full, %s not cached", digest)
                return False
            return self._retry_write(digest, data)
        self._filed(digest, len(data))
        return True

    def _filed(self, digest: str, size: int) -> None:
        with self._lock:
            if digest not in self._lru:
                self._used += size
            self._lru[digest] = size

    def put_toc(self, toc_digest: str, data: bytes, toc_offset: int) -> None:
        """Keep a verified TOC (checked by the caller against the layer annotation) and
        the offset of its member (where the last chunks end)."""
        path = self._tocs / digest_hex(toc_digest)
        if not path.exists():
            self._write(path, b"%d\n" % toc_offset + data)

    def get_toc(self, toc_digest: str) -> tuple[bytes, int] | None:
        """(TOC JSON, TOC offset) kept earlier, re-verified against its digest, or None."""
        try:
            head, _, data = (self._tocs / digest_hex(toc_digest)).read_bytes().partition(b"\n")
        except FileNotFoundError:
            return None
        if not head.isdigit() or "sha256:" + hashlib.sha256(data).hexdigest() != toc_digest:
            return None
        return data, int(head)

    def _retry_write(self, digest: str, data: bytes) -> bool:
        try:
            self._write(self._chunks / digest_hex(digest), data)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self.insert_failures += 1
            log.warning("chunk cache: disk full after eviction, %s not cached", digest)
            return False
        self._filed(digest, len(data))
        return True

    def _make_room(self, size: int) -> None:
        while self.used + size > self.limit and self._evict_one():
            pass

    def _evict_one(self) -> bool:
        """Drop the least recently used chunk; False when the cache is empty."""
        with self._lock:
            if not self._lru:
                return False
            digest, size = self._lru.popitem(last=False)
            self._used -= size
            self.evictions += 1
        self._fds.forget(digest)
        (self._chunks / digest_hex(digest)).unlink(missing_ok=True)
        return True

    def _write(self, final: Path, data: bytes) -> None:
        fd, name = tempfile.mkstemp(dir=self._tmp, prefix="chunk-")
        try:
            with os.fdopen(fd, "wb") as sink:
                sink.write(data)
            os.replace(name, final)
        except BaseException:
            Path(name).unlink(missing_ok=True)
            raise

    def _scan(self) -> None:
        """Seed the LRU from disk (oldest modification first); clear stale temp files."""
        for stale in self._tmp.iterdir():
            stale.unlink(missing_ok=True)
        found = []
        for path in self._chunks.iterdir():
            stat = path.stat()
            found.append((stat.st_mtime, "sha256:" + path.name, stat.st_size))
        for _, digest, size in sorted(found):
            self._lru[digest] = size
            self._used += size
