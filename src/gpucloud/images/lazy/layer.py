"""One lazily read eStargz layer: its verified TOC, chunk reads, background prefetch.

Reading ``n`` bytes of a file maps to the chunks that cover them; cached chunks are read
from the node's ``ChunkCache``, the missing ones are fetched together (adjacent and nearby
compressed extents merged into single Range requests), each gzip member decompressed from
its start (skipping ``innerOffset``, bounded to the chunk's size), hashed and compared with
its ``chunkDigest`` before a byte of it is served or cached. A chunk is fetched by one
thread at a time: others wanting it wait for that fetch (single flight).

Every fetch goes through the node's ``FetchScheduler`` (``scheduler.py``): reads at
``DEMAND`` priority, the prefetch (its own thread, right after the mount) first the
prioritized files (the ones before ``.prefetch.landmark``) at ``PRIORITY``, then the rest
at ``BULK``. Prefetch is dispatched only while no demand fetch is queued or on the wire
(the bulk only after demand has been quiet a while), and a read of a chunk queued for
prefetch promotes it, so a page fault never queues behind background bytes. The container
does not wait for the prefetch.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import itertools
import logging
import os
import re
import tarfile
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from gpucloud.images.errors import DigestMismatch, ImageError, InvalidImage
from gpucloud.images.lazy.cache import CachedFd, ChunkCache
from gpucloud.images.lazy.estargz import decompress_chunk
from gpucloud.images.lazy.fetch import RangeFetcher
from gpucloud.images.lazy.footer import LEGACY_FOOTER_SIZE, parse_footer_sized
from gpucloud.images.lazy.scheduler import Deliver, FetchScheduler, Item, Priority, wait_all
from gpucloud.images.lazy.toc import (
    HIDDEN_ROOT_NAMES,
    TOC_NAME,
    ChunkRef,
    InvalidToc,
    Toc,
    parse_toc,
)
from gpucloud.images.lazy.trace import mark

log = logging.getLogger(__name__)

TAIL_READ = 256 << 10
PREFETCH_WINDOW = 8 << 20
"""The prefetch submits this many compressed bytes at a time and waits for them (the
scheduler's queue stays short; unmounting cancels at most one window)."""

_fetch_ids = itertools.count(1)  # names a request's start and end lines in the trace

EventSink = Callable[[str, str], None]
"""Called with (reason, message) for what the agent should report as an event."""

READ_FAILURE_EVENT_INTERVAL = 60.0
"""At most one ``LazyReadFailed`` event per layer in this many seconds. A program retrying
reads against a dead registry fails every one of them (each within the read deadline); a
minute keeps the failure in the pod's events while it lasts without flooding the daemon's
node-wide queue (200 events), which would push out other pods' events. The failures in
between are counted into the next event."""


class ChunkCorrupt(DigestMismatch):
    """A fetched chunk did not hash to its ``chunkDigest``: never served, never cached."""

    reason = "ChunkDigestMismatch"


@dataclass
class LayerStats:
    """Counters for one layer (bytes are compressed wire bytes / uncompressed file bytes)."""

    demand_fetched: int = 0
    prefetched: int = 0
    #: Of ``prefetched``: the prioritized files (the landmark prefix).
    prefetched_priority: int = 0
    corrupt_chunks: int = 0
    errors: int = 0
    prefetch_done: bool = False


def read_toc(fetcher: RangeFetcher, toc_digest: str, *, ranges_only: bool = False
             ) -> tuple[Toc, bytes]:
    """Fetch footer and TOC (one Range request for the tail, usually), check the TOC's
    sha256 against ``toc_digest`` (the layer annotation) and parse it; return it and its
    JSON bytes. A TOC larger than the tail costs one more request, for the part of it
    before the tail only. ``ranges_only``: ``RangeUnsupported`` when the registry answers
    the tail's Range request with the whole blob (the daemon's check, in the same request)."""
    size = fetcher.size
    if size < LEGACY_FOOTER_SIZE:
        raise InvalidToc(f"blob of {size} bytes is too small for an eStargz footer")
    tail_start = max(0, size - TAIL_READ)
    tail = fetcher.fetch(tail_start, size, ranges_only=ranges_only)
    toc_offset, footer_size = parse_footer_sized(tail)
    if not 0 <= toc_offset < size - footer_size + 1:
        raise InvalidToc(f"footer points at {toc_offset}, outside the blob")
    if toc_offset >= tail_start:
        member = tail[toc_offset - tail_start : len(tail) - footer_size]
    else:
        member = fetcher.fetch(toc_offset, tail_start) + tail[: len(tail) - footer_size]
    data = toc_json(member)
    actual = "sha256:" + hashlib.sha256(data).hexdigest()
    if actual != toc_digest:
        raise DigestMismatch(toc_digest, f"the TOC hashed to {actual}", "eStargz TOC")
    return parse_toc(data, size, toc_offset), data


def toc_json(member: bytes) -> bytes:
    """The ``stargz.index.json`` bytes inside the TOC's gzip member (a tar entry)."""
    try:
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        raw = inflate.decompress(member, 512 << 20)
        if not inflate.eof:  # cut short (or past the bound): its CRC was never checked
            raise InvalidToc("the TOC member is truncated or larger than 512 MiB inflated")
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            info = tar.next()
            if info is None or info.name != TOC_NAME:
                raise InvalidToc("the TOC member does not hold stargz.index.json")
            stream = tar.extractfile(info)
            if stream is None:
                raise InvalidToc("stargz.index.json is not a regular file")
            return stream.read()
    except (zlib.error, tarfile.TarError) as exc:
        raise InvalidToc(f"the TOC member is not a gzip tar: {exc}") from exc


def decode_chunk(compressed: bytes, ref: ChunkRef) -> bytes:
    """One chunk's verified bytes (``estargz.decompress_chunk``), as ``ChunkCorrupt``."""
    try:
        return decompress_chunk(compressed, ref)
    except DigestMismatch as exc:
        raise ChunkCorrupt(ref.digest, str(exc), "chunk") from exc


class LazyLayer:
    """Serves file bytes of one layer from the chunk cache and the registry.

    Fetches go through the node's ``FetchScheduler`` (this layer is its ``Source``):
    reads as ``DEMAND``, the prefetch as ``PRIORITY`` (landmark prefix) then ``BULK``."""

    def __init__(
        self,
        digest: str,
        toc: Toc,
        fetcher: RangeFetcher | None,
        cache: ChunkCache,
        on_event: EventSink,
        scheduler: FetchScheduler | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.digest = digest
        self.toc = toc
        self.fetcher = fetcher
        self._cache = cache
        self._on_event = on_event
        self._own_scheduler = scheduler is None
        self.scheduler = scheduler if scheduler is not None else FetchScheduler()
        self._refs: dict[str, list[ChunkRef]] = {}
        self._by_digest: dict[str, ChunkRef] = {}
        self._all: list[ChunkRef] | None = None
        self.stats = LayerStats()
        self._clock = clock
        self._failure_lock = threading.Lock()
        self._last_failure_event: float | None = None
        self._failures_unreported = 0

    def close(self) -> None:
        """Drop this layer's queued prefetch (unmount); stop a scheduler of its own."""
        self.scheduler.cancel(self)
        if self._own_scheduler:
            self.scheduler.close()

    # -- reads ---------------------------------------------------------------------------

    def read(self, path: str, offset: int, size: int) -> bytes:
        """Bytes ``[offset, offset+size)`` of regular file ``path`` (short at its end).

        Fast path: every chunk cached, the slices are ``pread`` from the cache files (no
        whole-chunk copies, no re-hashing: the cache verified them on insert). Otherwise
        the missing chunks are fetched at ``DEMAND`` priority (ahead of any prefetch)."""
        refs = self._covering(path, offset, size)
        if not refs:
            return b""
        if len(refs) == 1:
            ref = refs[0]
            lo = offset - ref.chunk_offset
            hi = min(offset + size, ref.chunk_offset + ref.chunk_size) - ref.chunk_offset
            part = self._cache.read(ref.digest, lo, hi - lo)
            if part is not None and len(part) == hi - lo:
                return part
        else:
            parts = self._cached_slices(refs, offset, size)
            if parts is not None:
                return b"".join(parts)
        chunks = self._chunks(refs, Priority.DEMAND)
        data = b"".join(chunks[r.digest] for r in refs)
        start = offset - refs[0].chunk_offset
        return data[start : start + size]

    def _covering(self, path: str, offset: int, size: int) -> list[ChunkRef]:
        refs = self._refs.get(path)
        if refs is None:
            refs = self._refs[path] = self.toc.chunks_of(path)
        if len(refs) == 1:
            return refs
        end = offset + size
        first = max(0, bisect.bisect_right(refs, offset, key=_chunk_start) - 1)
        out = []
        for ref in refs[first:]:
            if ref.chunk_offset >= end:
                break
            if ref.chunk_offset + ref.chunk_size > offset:
                out.append(ref)
        return out

    def cached_extents(self, path: str, offset: int, size: int
                       ) -> list[tuple[CachedFd, int, int]] | None:
        """Where bytes ``[offset, offset+size)`` of ``path`` lie in the chunk cache: (open
        chunk file, position, length) per chunk, each descriptor held (give every one back
        with ``release_extents``); [] past the end; None when a chunk is not cached."""
        refs = self._covering(path, offset, size)
        out: list[tuple[CachedFd, int, int]] = []
        end = offset + size
        for ref in refs:
            handle = self._cache.acquire(ref.digest)
            if handle is None:
                self.release_extents(out)
                return None
            lo = max(offset, ref.chunk_offset) - ref.chunk_offset
            hi = min(end, ref.chunk_offset + ref.chunk_size) - ref.chunk_offset
            out.append((handle, lo, hi - lo))
        return out

    def advise_ahead(self, path: str, offset: int, span: int) -> None:
        """Start reading the cached chunk files behind ``[offset, offset+span)`` of ``path``
        into the page cache (``POSIX_FADV_WILLNEED``, asynchronous): a sequential reader's
        next FUSE requests then splice from memory instead of waiting on the disk, one
        1 MiB chunk file at a time. Chunks not cached are skipped (nothing is fetched)."""
        for ref in self._covering(path, offset, span):
            handle = self._cache.acquire(ref.digest)
            if handle is not None:
                try:
                    os.posix_fadvise(handle.fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    self._cache.release(handle)

    def fetch_missing(self, path: str, offset: int, size: int) -> None:
        """Fetch (at ``DEMAND``, verified, into the cache) the chunks behind ``[offset,
        offset+size)`` of ``path`` that are not cached, without handing their bytes back:
        the FUSE read then splices them from the chunk files (``cached_extents``) instead of
        joining, slicing and copying them into a fresh buffer (three copies of every byte
        and the page faults of a new 1 MiB buffer per request)."""
        missing = []
        for ref in self._covering(path, offset, size):
            if not self._cache.has(ref.digest):
                self._by_digest.setdefault(ref.digest, ref)
                missing.append(Item(ref.digest, ref.offset, ref.end))
        if missing:
            self.scheduler.fetch(self, _unique(missing), Priority.DEMAND)

    def read_failed(self, path: str, exc: BaseException) -> None:
        """A read of ``path`` failed (the reader gets ``EIO``): counted, and reported as a
        ``LazyReadFailed`` event, rate-limited (``READ_FAILURE_EVENT_INTERVAL``). A corrupt
        chunk is not reported twice: ``decode_items`` raised ``ChunkDigestMismatch``."""
        self.stats.errors += 1
        if isinstance(exc, ChunkCorrupt):
            return
        with self._failure_lock:
            now = self._clock()
            last = self._last_failure_event
            if last is not None and now - last < READ_FAILURE_EVENT_INTERVAL:
                self._failures_unreported += 1
                return
            self._last_failure_event = now
            unreported, self._failures_unreported = self._failures_unreported, 0
        more = f" ({unreported} more failed reads since the last event)" if unreported else ""
        self._on_event("LazyReadFailed", f"layer {self.digest}: read of {redacted_line(path)} "
                                         f"failed: {redacted_line(str(exc))}{more}")

    def release_extents(self, extents: list[tuple[CachedFd, int, int]]) -> None:
        for handle, _, _ in extents:
            self._cache.release(handle)

    def _cached_slices(self, refs: list[ChunkRef], offset: int, size: int) -> list[bytes] | None:
        """The wanted bytes as slices of cached chunks, or None when one is not cached."""
        parts = []
        end = offset + size
        for ref in refs:
            lo = max(offset, ref.chunk_offset) - ref.chunk_offset
            hi = min(end, ref.chunk_offset + ref.chunk_size) - ref.chunk_offset
            part = self._cache.read(ref.digest, lo, hi - lo)
            if part is None or len(part) != hi - lo:
                return None
            parts.append(part)
        return parts

    def _chunks(self, refs: list[ChunkRef], priority: Priority) -> dict[str, bytes]:
        """The verified bytes of ``refs``: cached ones from the cache, the others fetched
        through the scheduler (which shares a fetch already queued or on the wire)."""
        out: dict[str, bytes] = {}
        missing: list[Item] = []
        for ref in refs:
            if ref.digest in out:
                continue
            cached = self._cache.get(ref.digest)
            if cached is not None:
                out[ref.digest] = cached
                continue
            self._by_digest.setdefault(ref.digest, ref)
            missing.append(Item(ref.digest, ref.offset, ref.end))
        if missing:
            out.update(self.scheduler.fetch(self, _unique(missing), priority))
        return out

    def fetch_span(self, items: list[Item], priority: Priority) -> bytes:
        """``Source`` of the scheduler: the compressed bytes of ``items`` (adjacent, merged
        by the scheduler) in one Range request."""
        if self.fetcher is None:
            raise ImageError(f"layer {self.digest}: chunk not cached and no registry to fetch it")
        start, end = items[0].start, max(i.end for i in items)
        request = next(_fetch_ids)
        mark("fetch.start", id=request, layer=self.digest[7:19], priority=priority.name,
             start=start, end=end, chunks=len(items))
        blob = self.fetcher.fetch(start, end)
        mark("fetch.end", id=request, priority=priority.name, bytes=len(blob))
        if priority is Priority.DEMAND:
            self.stats.demand_fetched += len(blob)
        else:
            self.stats.prefetched += len(blob)
            if priority is Priority.PRIORITY:
                self.stats.prefetched_priority += len(blob)
        return blob

    def decode_items(self, items: list[Item], blob: bytes, deliver: Deliver) -> None:
        """``Source`` of the scheduler: verify each chunk of ``blob`` (``fetch_span``'s),
        insert it into the cache and ``deliver`` it, one by one; a corrupt chunk is never
        cached nor delivered, and is raised after the others."""
        start = items[0].start
        corrupt: ChunkCorrupt | None = None
        for item in items:
            ref = self._by_digest[item.key]
            try:
                data = decode_chunk(blob[item.start - start : item.end - start], ref)
            except ChunkCorrupt as exc:
                self.stats.corrupt_chunks += 1
                self._on_event("ChunkDigestMismatch", f"layer {self.digest}: {exc}")
                corrupt = exc
                continue
            self._cache.put(ref.digest, data, verified=True)
            deliver(ref.digest, data)
        if corrupt is not None:
            raise corrupt

    # -- prefetch ------------------------------------------------------------------------

    def prefetch(self, stop: threading.Event) -> None:
        """Fetch prioritized files (``PRIORITY``), then the rest (``BULK``) into the cache;
        stop early on ``stop``. The scheduler runs it only while no demand read waits (and
        the bulk only after demand has been quiet), so it never delays the start's reads.
        Work is submitted a window at a time, so the queue (and memory) stays small."""
        end = self.toc.prefetch_end()
        refs = self.all_chunks()
        try:
            for priority, part in ((Priority.PRIORITY, [r for r in refs if r.offset < end]),
                                   (Priority.BULK, [r for r in refs if r.offset >= end])):
                for window in _windows(part, PREFETCH_WINDOW):
                    if stop.is_set():
                        return
                    missing = [r for r in window if not self._cache.has(r.digest)]
                    for ref in missing:
                        self._by_digest.setdefault(ref.digest, ref)
                    items = _unique([Item(r.digest, r.offset, r.end) for r in missing])
                    wait_all(self.scheduler.submit(self, items, priority))
            self.stats.prefetch_done = not stop.is_set()
        except (ImageError, OSError) as exc:
            self.stats.errors += 1
            self._on_event("PrefetchFailed", f"layer {self.digest}: prefetch stopped: {exc}")
        except RuntimeError:  # the scheduler closed under us (daemon shutdown)
            return

    def all_chunks(self) -> list[ChunkRef]:
        """Every chunk of every visible regular file (no landmarks), in blob order (sorted
        once: the TOC never changes, and ``status`` asks for it per layer each time)."""
        if self._all is None:
            refs = [ref for path, chunks in self.toc.chunk_map().items()
                    if path not in HIDDEN_ROOT_NAMES for ref in chunks]
            self._all = sorted(refs, key=_blob_order)
        return self._all

    def local_bytes(self) -> tuple[int, int]:
        """(uncompressed bytes cached, uncompressed bytes in total) of this layer's files."""
        refs = self._chunk_sizes()
        local = sum(size for digest, size in refs.items() if self._cache.has(digest))
        return local, sum(refs.values())

    def total_bytes(self) -> int:
        """What this layer's files take in the (content-addressed) chunk cache once all
        are fetched: each distinct chunk once, uncompressed; landmarks are not cached."""
        return sum(self._chunk_sizes().values())

    def _chunk_sizes(self) -> dict[str, int]:
        return {r.digest: r.chunk_size for r in self.all_chunks()}


_URL = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?:[^/\s@]*@)?"
                  r"(?P<rest>[^\s?#]*)(?P<query>\?\S*)?")


def redacted_line(text: str) -> str:
    """``text`` for an event: one line, without the user-info or the query string of any
    URL in it (a presigned storage URL's signature, a token in a query)."""
    return _URL.sub(lambda m: m["scheme"] + m["rest"] + ("?..." if m["query"] else ""),
                    " ".join(text.split()))


def _chunk_start(ref: ChunkRef) -> int:
    return ref.chunk_offset


def _blob_order(ref: ChunkRef) -> tuple[int, int]:
    return ref.offset, ref.chunk_offset


def _unique(items: list[Item]) -> list[Item]:
    """One item per key (a file stored twice has one digest: one fetch)."""
    seen: dict[str, Item] = {}
    for item in items:
        seen.setdefault(item.key, item)
    return list(seen.values())


def _windows(refs: list[ChunkRef], size: int) -> list[list[ChunkRef]]:
    """``refs`` cut into runs of about ``size`` compressed bytes."""
    out: list[list[ChunkRef]] = [[]]
    have = 0
    for ref in refs:
        if have >= size:
            out.append([])
            have = 0
        out[-1].append(ref)
        have += ref.end - ref.offset
    return out if out[0] else []


def check_toc_offsets(toc: Toc, blob_size: int) -> None:
    """Every chunk extent lies inside the blob (parse_toc checks offsets; extents too)."""
    for path, refs in toc.chunk_map().items():
        for ref in refs:
            if ref.end > blob_size or ref.end <= ref.offset:
                raise InvalidImage(f"TOC chunk of {path!r} runs outside the blob")
