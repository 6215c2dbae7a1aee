"""Rate limits on authentication failures: small in-process token buckets.

Each failed authentication (a 401 on the REST API, a refused public key at the SSH
gateway) takes a token from the bucket of the client's address and, on the API, from the
bucket of the key's printed prefix (its first 10 characters, as ``gpucloud key list``
shows them). A bucket holds ``burst`` tokens and refills at ``per_minute``; while one of a
request's buckets is empty, the request is refused at once (429 with ``Retry-After`` on the
API, the key refused at the gateway) — valid credentials included, so that a blocked
guesser learns nothing from the answers. Successful requests take nothing.

In-process: each server replica counts on its own, so N replicas allow N times the rate;
put a limit on the load balancer for a hard fleet-wide bound. The address is the TCP peer:
``X-Forwarded-For`` is not trusted (anyone can send one). Time comes from the caller (the
service clock), so tests drive it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from gpucloud.core.errors import GpucloudError

PREFIX_CHARS = 10
MAX_BUCKETS = 100_000


class RateLimited(GpucloudError):
    """Too many failed authentications from this address or for this key (API: 429)."""

    def __init__(self, message: str, retry_after_seconds: float) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


@dataclass(frozen=True)
class Policy:
    burst: int
    per_minute: float

    @property
    def per_second(self) -> float:
        return self.per_minute / 60


@dataclass
class _Bucket:
    tokens: float
    at: float


class AuthFailureLimiter:
    """Buckets by key (``addr:127.0.0.1``, ``prefix:gpc_abc123``); thread-safe."""

    def __init__(self, max_buckets: int = MAX_BUCKETS) -> None:
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()
        self._max = max_buckets

    def _refilled(self, key: str, now: float, policy: Policy) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            return _Bucket(float(policy.burst), now)
        elapsed = max(0.0, now - bucket.at)
        return _Bucket(min(float(policy.burst), bucket.tokens + elapsed * policy.per_second),
                       now)

    def retry_after(self, keys: Iterable[str], now: float, policy: Policy) -> float | None:
        """Seconds until every bucket of ``keys`` has a token again; None when all have."""
        with self._lock:
            waits = [(1 - bucket.tokens) / policy.per_second
                     for bucket in (self._refilled(key, now, policy) for key in keys)
                     if bucket.tokens < 1]
        return max(waits) if waits else None

    def check(self, keys: Iterable[str], now: float, policy: Policy) -> None:
        wait = self.retry_after(keys, now, policy)
        if wait is not None:
            raise RateLimited("too many failed authentications; retry in "
                              f"{math.ceil(wait)} s", wait)

    def failed(self, keys: Iterable[str], now: float, policy: Policy) -> None:
        """Take a token from each bucket of ``keys``."""
        with self._lock:
            if len(self._buckets) >= self._max:
                self._prune(now, policy)
            for key in keys:
                bucket = self._refilled(key, now, policy)
                bucket.tokens = max(0.0, bucket.tokens - 1)
                self._buckets[key] = bucket

    def _prune(self, now: float, policy: Policy) -> None:
        """Drop buckets that have refilled (they are as good as new); all, if none has."""
        full = [key for key in self._buckets
                if self._refilled(key, now, policy).tokens >= policy.burst]
        for key in full or list(self._buckets):
            del self._buckets[key]


def api_keys(address: str | None, credential: str | None) -> list[str]:
    """The buckets an API request's failure counts against."""
    keys = [f"addr:{address or 'unknown'}"]
    if credential:
        keys.append(f"prefix:{credential[:PREFIX_CHARS]}")
    return keys
