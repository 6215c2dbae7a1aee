"""HTTP Range reads of one registry blob, for lazily mounted layers.

What registries really do, and what this module does about it:

* The registry usually answers a blob GET with a redirect to blob storage (S3, GCS, a CDN)
  under a presigned URL. The redirect is followed by hand, with a client that carries no
  registry credentials (they are for the registry alone); the resolved URL is reused for
  later ranges, and when storage answers ``403`` (the presigned URL expired) the registry
  is asked again, once.
* ``401`` mid-run (a bearer token expired) is answered by ``RegistryAuth`` on the registry
  client, which fetches a fresh token and resends.
* Only single ranges are sent (some storage backends refuse multi-range requests); the
  layer merges adjacent and nearby chunks into one span before calling ``fetch``.
* A ``200`` with the whole blob (Go's ``ServeContent`` does that, and so does a server
  without Range support) is accepted: the body is streamed, the bytes before the span are
  skipped, and the connection is closed after the span, so the blob is never buffered.
* A ``206`` is read to its end (the body is the span), so its connection goes back to the
  pool: returning as soon as the span's bytes were in left the response unfinished, and
  closing it closed the connection, so every chunk fetch paid a new TCP (and, at a real
  registry, TLS) handshake.
* ``429``/``5xx`` and broken connections are retried with exponential back-off (honouring
  ``Retry-After``) until the attempts or the read deadline run out; then the caller gets
  ``RegistryUnavailable`` (the FUSE layer turns it into ``EIO`` and an event).
* The read deadline bounds the whole fetch, not only its retries: every request's
  timeouts are cut to the time left, and a body still arriving at the deadline (a server
  trickling bytes, each read within its timeout) is given up. A FUSE reader runs its own
  fetch in its thread (``scheduler.py``), so this is what bounds its wait there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from gpucloud.images.errors import ImageError, RegistryUnauthorized, RegistryUnavailable

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_RETRYABLE = frozenset({408, 425, 429, 500, 502, 503, 504})
_MAX_RETRY_AFTER = 5.0


class RangeUnsupported(ImageError):
    """The registry (or its storage) ignores Range requests: pull the layer whole."""

    reason = "RangeUnsupported"


@dataclass
class FetchStats:
    """What went over the wire for one blob (counted for ``image list`` and the bench)."""

    requests: int = 0
    bytes: int = 0
    retries: int = 0


@dataclass(frozen=True)
class Span:
    """Compressed bytes ``[start, end)`` of a blob, fetched in one request."""

    start: int
    end: int


def merge_spans(spans: list[Span], gap: int, max_size: int) -> list[Span]:
    """Sort and merge spans that touch or are less than ``gap`` apart, no span over
    ``max_size`` unless a single input span already is (the gap bytes are fetched too:
    one request is cheaper than two round trips for a few KiB)."""
    merged: list[Span] = []
    for span in sorted(spans, key=lambda s: s.start):
        if merged:
            last = merged[-1]
            if span.start - last.end <= gap and max(span.end, last.end) - last.start <= max_size:
                merged[-1] = Span(last.start, max(last.end, span.end))
                continue
        merged.append(span)
    return merged


class RangeFetcher:
    """Fetches byte ranges of one blob: ``url`` is the registry's ``/v2/<repo>/blobs/<d>``.

    ``registry_http`` carries the registry auth and must not follow redirects;
    ``storage_http`` has no auth and is used for redirect targets. ``sleep`` and ``clock``
    are injectable so tests of the back-off do not wait on the wall clock.
    """

    def __init__(
        self,
        registry_http: httpx.Client,
        storage_http: httpx.Client,
        url: str,
        size: int,
        *,
        attempts: int = 5,
        backoff: float = 0.05,
        deadline: float = 30.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry_http
        self._storage = storage_http
        self.url = url
        self.size = size
        self._attempts = attempts
        self._backoff = backoff
        self._deadline = deadline
        self._sleep = sleep
        self._clock = clock
        self._resolved: str | None = None
        self._lock = threading.Lock()
        self.stats = FetchStats()

    def supports_ranges(self) -> bool:
        """Ask for the blob's first byte: True on ``206``, False when the whole blob comes."""
        with self._request(0, 1, self._clock() + self._deadline) as response:
            return response.status_code == 206

    def fetch(self, start: int, end: int, *, ranges_only: bool = False) -> bytes:
        """Bytes ``[start, end)`` of the blob, retried within the read deadline.

        ``ranges_only``: a ``200`` (the whole blob: the server ignores Range) raises
        ``RangeUnsupported`` at once instead of being streamed through; the first request
        of a mount (the TOC) is so also its Range-support check, with no round trip of
        its own."""
        if not 0 <= start < end <= self.size:
            raise ValueError(f"range [{start}, {end}) outside the blob of {self.size} bytes")
        give_up = self._clock() + self._deadline
        for attempt in range(1, self._attempts + 1):
            try:
                return self._fetch_once(start, end, ranges_only, give_up)
            except _Retryable as exc:
                if attempt == self._attempts or self._clock() + exc.wait(self, attempt) > give_up:
                    raise RegistryUnavailable(
                        f"reading bytes {start}-{end - 1} of {self.url} failed: {exc}"
                    ) from exc
                self.stats.retries += 1
                self._sleep(exc.wait(self, attempt))
        raise AssertionError("unreachable")

    def _fetch_once(self, start: int, end: int, ranges_only: bool, give_up: float) -> bytes:
        with self._request(start, end, give_up) as response:
            if response.status_code == 206:
                return self._read_partial(response, start, end, give_up)
            if ranges_only:
                raise RangeUnsupported(f"{self.url} ignores Range requests (HTTP "
                                       f"{response.status_code} with the whole blob)")
            return self._read_from_whole(response, start, end, give_up)

    def _read_partial(self, response: httpx.Response, start: int, end: int,
                      give_up: float) -> bytes:
        first = _content_range_start(response.headers.get("Content-Range", ""))
        if first != start:
            raise _Retryable(f"asked for offset {start}, got a range from {first}")
        return self._read_exactly(response, end - start, 0, give_up, finish=True)

    def _read_from_whole(self, response: httpx.Response, start: int, end: int,
                         give_up: float) -> bytes:
        """A ``200``: skip to ``start`` while streaming, keep ``end - start`` bytes, close."""
        return self._read_exactly(response, end - start, start, give_up)

    def _read_exactly(self, response: httpx.Response, count: int, skip: int, give_up: float,
                      finish: bool = False) -> bytes:
        """``count`` bytes after the first ``skip`` of the body, by ``give_up``. ``finish``:
        the body should be exactly those bytes; it is read to its end (one more, empty,
        read) so the connection is reused; a longer body is cut and its connection closed."""
        parts: list[bytes] = []
        have = 0
        try:
            chunks = response.iter_raw()
            for chunk in chunks:
                if self._clock() > give_up:
                    raise _Retryable(f"the read deadline passed after {have} of {count} bytes")
                self.stats.bytes += len(chunk)
                if skip:
                    dropped = min(skip, len(chunk))
                    chunk, skip = chunk[dropped:], skip - dropped
                parts.append(chunk)
                have += len(chunk)
                if have >= count:
                    if finish and have == count:
                        self.stats.bytes += len(next(chunks, b""))
                    return b"".join(parts)[:count]
        except httpx.TransportError as exc:
            raise _Retryable(f"the download broke off: {exc}") from exc
        raise _Retryable(f"the response ended after {have} of {count} bytes")

    def _request(self, start: int, end: int, give_up: float) -> _Response:
        """Open a streamed GET of the range at the resolved URL (resolving it as needed)."""
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        self.stats.requests += 1
        url = self._location(give_up)
        client = self._storage if url != self.url else self._registry
        response = self._open(client, url, headers, give_up)
        if response.status_code == 403 and url != self.url:
            response.close()
            with self._lock:
                self._resolved = None
            url = self._location(give_up)
            response = self._open(self._storage, url, headers, give_up)
        self._check(response)
        return _Response(response)

    def _location(self, give_up: float) -> str:
        """The blob's storage URL: the registry's redirect target, cached until a 403.

        Only the registry is asked (HEAD); the target itself is not probed, because a
        presigned URL is signed for GET alone (S3 answers a HEAD with 403). Further hops
        at the storage side are followed by the GET (its client carries no auth)."""
        with self._lock:
            if self._resolved is not None:
                return self._resolved
        request = self._registry.build_request(
            "HEAD", self.url, timeout=self._timeout(self._registry, give_up))
        try:
            response = self._registry.send(request)
        except httpx.TransportError as exc:
            raise _Retryable(f"cannot reach {request.url.netloc.decode()}: {exc}") from exc
        response.close()
        url = self.url
        if response.status_code in _REDIRECTS and "Location" in response.headers:
            url = str(response.url.join(response.headers["Location"]))
        else:
            self._check(response)
        with self._lock:
            self._resolved = url
        return url

    def _open(self, client: httpx.Client, url: str, headers: dict[str, str],
              give_up: float) -> httpx.Response:
        request = client.build_request("GET", url, headers=headers,
                                       timeout=self._timeout(client, give_up))
        try:
            return client.send(request, stream=True, follow_redirects=client is self._storage)
        except httpx.TransportError as exc:
            raise _Retryable(f"cannot reach {request.url.netloc.decode()}: {exc}") from exc

    def _timeout(self, client: httpx.Client, give_up: float) -> httpx.Timeout:
        """The client's timeouts, none longer than the time left until ``give_up``."""
        left = max(0.001, give_up - self._clock())
        own = client.timeout

        def cut(value: float | None) -> float:
            return left if value is None else min(value, left)

        return httpx.Timeout(connect=cut(own.connect), read=cut(own.read),
                             write=cut(own.write), pool=cut(own.pool))

    def _check(self, response: httpx.Response) -> None:
        status = response.status_code
        if status in (200, 206):
            return
        response.close()
        if status in _RETRYABLE:
            raise _Retryable(f"HTTP {status}", response.headers.get("Retry-After"))
        if status in (401, 403):
            raise RegistryUnauthorized(f"access to {self.url} refused (HTTP {status})")
        raise RegistryUnavailable(f"registry answered HTTP {status} for {self.url}")


class _Response:
    """Closes the streamed response when the ``with`` block ends."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response

    def __enter__(self) -> httpx.Response:
        return self.response

    def __exit__(self, *exc_info: object) -> None:
        self.response.close()


class _Retryable(Exception):
    """A failure worth retrying; ``retry_after`` is the server's hint, if any."""

    def __init__(self, message: str, retry_after: str | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def wait(self, fetcher: RangeFetcher, attempt: int) -> float:
        """Seconds to wait before the next attempt: Retry-After, else exponential."""
        if self.retry_after and self.retry_after.isdigit():
            return min(float(self.retry_after), _MAX_RETRY_AFTER)
        return float(fetcher._backoff * (2 ** (attempt - 1)))


def _content_range_start(header: str) -> int:
    """The first byte of ``Content-Range: bytes A-B/N``; -1 when unparsable."""
    try:
        unit, _, rest = header.partition(" ")
        return int(rest.split("-", 1)[0]) if unit == "bytes" else -1
    except ValueError:
        return -1
