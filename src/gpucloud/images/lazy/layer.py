"""One lazily read eStargz layer: its verified TOC, chunk reads, background prefetch.

Reading ``n`` bytes of a file maps to the chunks that cover them; cached chunks are read
from the node's ``ChunkCache``, the missing ones are fetched together (adjacent and nearby
compressed extents merged into single Range requests), each gzip member decompressed from
its start (skipping ``innerOffset``, bounded to the chunk's size), hashed and compared with
its ``chunkDigest`` before a byte of it is served or cached. A chunk is fetched by one
thread at a time: others wanting it wait for that fetch (single flight).

Prefetch runs on its own thread: first the prioritized files (the ones before
``.prefetch.landmark``), then everything else, in TOC order; it steps aside while
on-demand reads are in progress, so a page fault never queues behind background bytes.
The container does not wait for it.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import logging
import tarfile
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from gpucloud.images.errors import DigestMismatch, ImageError, InvalidImage
from gpucloud.images.lazy.cache import ChunkCache
from gpucloud.images.lazy.estargz import decompress_chunk
from gpucloud.images.lazy.fetch import RangeFetcher, Span, merge_spans
from gpucloud.images.lazy.footer import FOOTER_SIZE, parse_footer
from gpucloud.images.lazy.toc import (
    HIDDEN_ROOT_NAMES,
    TOC_NAME,
    ChunkRef,
    InvalidToc,
    Toc,
    parse_toc,
)

log = logging.getLogger(__name__)

TAIL_READ = 256 << 10
MERGE_GAP = 256 << 10
MAX_REQUEST = 16 << 20
PREFETCH_BATCH = 1 << 20
"""Background fetches go out in ~1 MiB requests: a demand read that arrives meanwhile
waits at most one of them (8 ms at 1 Gbit/s) for the link."""
PREFETCH_DELAY = 1.0
"""Prefetch starts at the first demand read or this many seconds after the mount."""
DEMAND_QUIET = 0.05
"""Prefetch resumes only after demand reads have been idle this long (a starting program
reads in bursts; the gaps between its reads are far shorter)."""

EventSink = Callable[[str, str], None]
"""Called with (reason, message) for what the agent should report as an event."""


class ChunkCorrupt(DigestMismatch):
    """A fetched chunk did not hash to its ``chunkDigest``: never served, never cached."""

    reason = "ChunkDigestMismatch"


@dataclass
class LayerStats:
    """Counters for one layer (bytes are compressed wire bytes / uncompressed file bytes)."""

    demand_fetched: int = 0
    prefetched: int = 0
    corrupt_chunks: int = 0
    errors: int = 0
    prefetch_done: bool = False


def read_toc(fetcher: RangeFetcher, toc_digest: str) -> tuple[Toc, bytes]:
    """Fetch footer and TOC (one Range request for the tail, usually), check the TOC's
    sha256 against ``toc_digest`` (the layer annotation) and parse it; return it and its
    JSON bytes."""
    size = fetcher.size
    if size < FOOTER_SIZE:
        raise InvalidToc(f"blob of {size} bytes is too small for an eStargz footer")
    tail_start = max(0, size - TAIL_READ)
    tail = fetcher.fetch(tail_start, size)
    toc_offset = parse_footer(tail)
    if not 0 <= toc_offset < size - FOOTER_SIZE + 1:
        raise InvalidToc(f"footer points at {toc_offset}, outside the blob")
    if toc_offset >= tail_start:
        member = tail[toc_offset - tail_start : len(tail) - FOOTER_SIZE]
    else:
        member = fetcher.fetch(toc_offset, size - FOOTER_SIZE)
    data = toc_json(member)
    actual = "sha256:" + hashlib.sha256(data).hexdigest()
    if actual != toc_digest:
        raise DigestMismatch(toc_digest, f"the TOC hashed to {actual}", "eStargz TOC")
    return parse_toc(data, size, toc_offset), data


def toc_json(member: bytes) -> bytes:
    """The ``stargz.index.json`` bytes inside the TOC's gzip member (a tar entry)."""
    try:
        raw = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(member, 512 << 20)
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
    """Serves file bytes of one layer from the chunk cache and the registry."""

    def __init__(
        self,
        digest: str,
        toc: Toc,
        fetcher: RangeFetcher | None,
        cache: ChunkCache,
        on_event: EventSink,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.digest = digest
        self.toc = toc
        self.fetcher = fetcher
        self._cache = cache
        self._on_event = on_event
        self._lock = threading.Lock()
        self._inflight: dict[str, Future[bytes]] = {}
        self._demand = 0
        self._last_demand = 0.0
        self._first_demand = threading.Event()
        self._idle = threading.Condition(self._lock)
        self._refs: dict[str, list[ChunkRef]] = {}
        self._clock = clock
        self.prefetch_delay = PREFETCH_DELAY
        self.stats = LayerStats()

    # -- reads ---------------------------------------------------------------------------

    def read(self, path: str, offset: int, size: int) -> bytes:
        """Bytes ``[offset, offset+size)`` of regular file ``path`` (short at its end).

        Fast path: every chunk cached, the slices are ``pread`` from the cache files (no
        whole-chunk copies, no re-hashing: the cache verified them on insert)."""
        refs = self._covering(path, offset, size)
        if not refs:
            return b""
        parts = self._cached_slices(refs, offset, size)
        if parts is not None:
            return b"".join(parts)
        self._demand_begins()
        try:
            chunks = self._chunks(refs, background=False)
        finally:
            self._demand_ends()
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

    def _demand_begins(self) -> None:
        with self._lock:
            self._demand += 1
            self._last_demand = self._clock()
        self._first_demand.set()

    def _demand_ends(self) -> None:
        with self._lock:
            self._demand -= 1
            self._last_demand = self._clock()
            self._idle.notify_all()

    def _chunks(self, refs: list[ChunkRef], background: bool) -> dict[str, bytes]:
        """The verified bytes of ``refs``, from the cache or fetched (single flight)."""
        out: dict[str, bytes] = {}
        mine: list[ChunkRef] = []
        waits: dict[str, Future[bytes]] = {}
        for ref in refs:
            if ref.digest in out or ref.digest in waits:
                continue
            cached = self._cache.get(ref.digest)
            if cached is not None:
                out[ref.digest] = cached
                continue
            with self._lock:
                future = self._inflight.get(ref.digest)
                if future is None:
                    self._inflight[ref.digest] = Future()
                    mine.append(ref)
                else:
                    waits[ref.digest] = future
        if mine:
            out.update(self._fetch(mine, background))
        for digest, future in waits.items():
            out[digest] = future.result()
        return out

    def _fetch(self, refs: list[ChunkRef], background: bool) -> dict[str, bytes]:
        """Fetch ``refs`` (claimed by this thread) in merged spans; resolve their futures."""
        got: dict[str, bytes] = {}
        try:
            for span in merge_spans([Span(r.offset, r.end) for r in refs], MERGE_GAP, MAX_REQUEST):
                got.update(self._fetch_span(span, [r for r in refs
                                                    if span.start <= r.offset < span.end],
                                             background))
        except BaseException as exc:
            self._fail(refs, got, exc)
            raise
        self._resolve(refs, got)
        return got

    def _fetch_span(self, span: Span, refs: list[ChunkRef], background: bool) -> dict[str, bytes]:
        if self.fetcher is None:
            raise ImageError(f"layer {self.digest}: chunk not cached and no registry to fetch it")
        blob = self.fetcher.fetch(span.start, span.end)
        if background:
            self.stats.prefetched += len(blob)
        else:
            self.stats.demand_fetched += len(blob)
        got: dict[str, bytes] = {}
        for ref in refs:
            try:
                data = decode_chunk(blob[ref.offset - span.start : ref.end - span.start], ref)
            except ChunkCorrupt as exc:
                self.stats.corrupt_chunks += 1
                self._on_event("ChunkDigestMismatch", f"layer {self.digest}: {exc}")
                raise
            self._cache.put(ref.digest, data)
            got[ref.digest] = data
        return got

    def _resolve(self, refs: list[ChunkRef], got: dict[str, bytes]) -> None:
        with self._lock:
            for ref in refs:
                future = self._inflight.pop(ref.digest, None)
                if future is not None:
                    future.set_result(got[ref.digest])

    def _fail(self, refs: list[ChunkRef], got: dict[str, bytes], exc: BaseException) -> None:
        with self._lock:
            for ref in refs:
                future = self._inflight.pop(ref.digest, None)
                if future is None:
                    continue
                if ref.digest in got:
                    future.set_result(got[ref.digest])
                else:
                    future.set_exception(exc)

    # -- prefetch ------------------------------------------------------------------------

    def prefetch(self, stop: threading.Event) -> None:
        """Fetch prioritized files, then the rest, into the cache; stop early on ``stop``.

        It waits for the first demand read (or ``prefetch_delay``), and before each batch
        for demand reads to be idle for ``DEMAND_QUIET``, so the start's own reads never
        queue behind background bytes on the link."""
        self._first_demand.wait(self.prefetch_delay)
        try:
            for batch in self._prefetch_batches():
                if stop.is_set():
                    return
                self._wait_for_idle(stop)
                missing = [r for r in batch if not self._cache.has(r.digest)]
                if missing:
                    self._chunks(missing, background=True)
            self.stats.prefetch_done = True
        except (ImageError, OSError) as exc:
            self.stats.errors += 1
            self._on_event("PrefetchFailed", f"layer {self.digest}: prefetch stopped: {exc}")

    def _wait_for_idle(self, stop: threading.Event) -> None:
        with self._idle:
            while not stop.is_set():
                quiet = self._clock() - self._last_demand
                if not self._demand and quiet >= DEMAND_QUIET:
                    return
                self._idle.wait(0.5 if self._demand else DEMAND_QUIET - quiet)

    def _prefetch_batches(self) -> list[list[ChunkRef]]:
        """All chunks in prefetch order (landmark prefix first), in batches of ~8 MiB."""
        end = self.toc.prefetch_end()
        refs = self.all_chunks()
        ordered = [r for r in refs if r.offset < end] + [r for r in refs if r.offset >= end]
        batches: list[list[ChunkRef]] = [[]]
        size = 0
        for ref in ordered:
            if size >= PREFETCH_BATCH:
                batches.append([])
                size = 0
            batches[-1].append(ref)
            size += ref.end - ref.offset
        return batches

    def all_chunks(self) -> list[ChunkRef]:
        """Every chunk of every visible regular file (no landmarks), in blob order."""
        refs: list[ChunkRef] = []
        for ent in self.toc.files():
            if ent.type == "reg" and ent.size > 0 and ent.path not in HIDDEN_ROOT_NAMES:
                refs.extend(self.toc.chunks_of(ent.name))
        return sorted(refs, key=lambda r: (r.offset, r.chunk_offset))

    def local_bytes(self) -> tuple[int, int]:
        """(uncompressed bytes cached, uncompressed bytes in total) of this layer's files."""
        refs = {r.digest: r.chunk_size for r in self.all_chunks()}
        local = sum(size for digest, size in refs.items() if self._cache.has(digest))
        return local, sum(refs.values())


def _chunk_start(ref: ChunkRef) -> int:
    return ref.chunk_offset


def check_toc_offsets(toc: Toc, blob_size: int) -> None:
    """Every chunk extent lies inside the blob (parse_toc checks offsets; extents too)."""
    for ent in toc.files():
        if ent.type == "reg" and ent.size > 0:
            for ref in toc.chunks_of(ent.name):
                if ref.end > blob_size or ref.end <= ref.offset:
                    raise InvalidImage(f"TOC chunk of {ent.name!r} runs outside the blob")
