"""Rate limits on authentication failures: small in-process token buckets.

Each failed authentication (a 401 on the REST API, a refused public key at the SSH
gateway) takes a token from the bucket of the credential's printed prefix (its first 10
characters, as ``gpucloud key list`` shows them) and from the bucket of the client's
address. A credential's bucket holds ``burst`` tokens and refills at ``per_minute``; the
address's holds ``address_factor`` times as many and refills that much faster, since one
address can be many honest callers (a host-network node: its agent and its pods' workers)
and one of them spinning on a bad key must not lock out the others: that key is limited by
its own bucket long before the address's is empty. While one of a request's buckets is
empty, the request is refused at once (429 with ``Retry-After`` on the API, the key
refused at the gateway) without checking its credential, so that a blocked guesser learns
nothing from the answers — except a credential that has already authenticated from this
very address (``succeeded``: a bounded set of hashes of address and credential), which is
checked as usual: its caller learns nothing it did not know, and a working agent is never
starved by a failing neighbour. Such a credential's own failure (a revoked key) counts
and forgets it. Successful requests take nothing.

In-process: each server replica counts on its own, so N replicas allow N times the rate;
put a limit on the load balancer for a hard fleet-wide bound. The address is the TCP peer:
``X-Forwarded-For`` is not trusted (anyone can send one). Time comes from the caller (the
service clock), so tests drive it.
"""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass, field

from gpucloud.core.errors import GpucloudError

PREFIX_CHARS = 10
MAX_BUCKETS = 100_000
#: Credentials remembered as having authenticated from their address (only a working
#: credential gets in, so no guesser fills it; the oldest go first).
MAX_TRUSTED = 100_000


class RateLimited(GpucloudError):
    """Too many failed authentications from this address or for this key (API: 429)."""

    def __init__(self, message: str, retry_after_seconds: float) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


@dataclass(frozen=True)
class Policy:
    """A credential's bucket; an address's (a wide bucket) gets ``address_factor`` times it."""

    burst: float
    per_minute: float
    address_factor: float = 1.0

    @property
    def per_second(self) -> float:
        return self.per_minute / 60

    def of(self, wide: bool) -> Policy:
        if not wide or self.address_factor == 1.0:
            return self
        return Policy(self.burst * self.address_factor, self.per_minute * self.address_factor)


@dataclass(frozen=True)
class Limits:
    """What one authentication counts against: its buckets, each with whether it is wide
    (an address's: ``Policy.address_factor``), and (on the API) the address and credential
    it came with, whose earlier success from there exempts it from empty buckets."""

    buckets: tuple[tuple[str, bool], ...]
    address: str | None = None
    credential: str | None = field(default=None, repr=False)

    def trust_key(self) -> str | None:
        """A hash of address and credential (the set keeps no secret); None without one."""
        if not self.credential or self.address is None:
            return None
        return hashlib.blake2b(f"{self.address}\0{self.credential}".encode(),
                               digest_size=16).hexdigest()


@dataclass
class _Bucket:
    tokens: float
    at: float
    policy: Policy


class AuthFailureLimiter:
    """Buckets by key (``addr:127.0.0.1``, ``prefix:gpc_abc123``) and the credentials
    that authenticated from their address; thread-safe."""

    def __init__(self, max_buckets: int = MAX_BUCKETS,
                 max_trusted: int = MAX_TRUSTED) -> None:
        self._buckets: dict[str, _Bucket] = {}
        self._trusted: dict[str, None] = {}  # insertion order: the oldest go first
        self._lock = threading.Lock()
        self._max = max_buckets
        self._max_trusted = max_trusted

    def _refilled(self, key: str, now: float, policy: Policy) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            return _Bucket(policy.burst, now, policy)
        elapsed = max(0.0, now - bucket.at)
        return _Bucket(min(policy.burst, bucket.tokens + elapsed * policy.per_second),
                       now, policy)

    def retry_after(self, limits: Limits, now: float, policy: Policy) -> float | None:
        """Seconds until every bucket of ``limits`` has a token again; None when all have,
        or when its credential has authenticated from its address before."""
        with self._lock:
            waits = []
            for key, wide in limits.buckets:
                scaled = policy.of(wide)
                bucket = self._refilled(key, now, scaled)
                if bucket.tokens < 1:
                    waits.append((1 - bucket.tokens) / scaled.per_second)
            if not waits:
                return None
            trusted = limits.trust_key()
            if trusted is not None and trusted in self._trusted:
                return None
        return max(waits)

    def check(self, limits: Limits, now: float, policy: Policy) -> None:
        wait = self.retry_after(limits, now, policy)
        if wait is not None:
            raise RateLimited("too many failed authentications; retry in "
                              f"{math.ceil(wait)} s", wait)

    def failed(self, limits: Limits, now: float, policy: Policy) -> None:
        """Take a token from each bucket of ``limits``; forget its credential's success."""
        trusted = limits.trust_key()
        with self._lock:
            if len(self._buckets) >= self._max:
                self._prune(now)
            for key, wide in limits.buckets:
                bucket = self._refilled(key, now, policy.of(wide))
                bucket.tokens = max(0.0, bucket.tokens - 1)
                self._buckets[key] = bucket
            if trusted is not None:
                self._trusted.pop(trusted, None)

    def succeeded(self, limits: Limits) -> None:
        """Remember that this credential authenticated from this address."""
        trusted = limits.trust_key()
        if trusted is None:
            return
        with self._lock:
            if trusted in self._trusted:
                return
            if len(self._trusted) >= self._max_trusted:
                del self._trusted[next(iter(self._trusted))]
            self._trusted[trusted] = None

    def _prune(self, now: float) -> None:
        """Drop buckets that have refilled (they are as good as new); all, if none has."""
        full = [key for key, bucket in self._buckets.items()
                if self._refilled(key, now, bucket.policy).tokens >= bucket.policy.burst]
        for key in full or list(self._buckets):
            del self._buckets[key]


def api_keys(address: str | None, credential: str | None) -> Limits:
    """What an API request's failure counts against: its address (wide) and its
    credential's prefix; an earlier success of the credential from the address exempts."""
    address = address or "unknown"
    buckets: tuple[tuple[str, bool], ...] = ((f"addr:{address}", True),)
    if credential:
        buckets += ((f"prefix:{credential[:PREFIX_CHARS]}", False),)
    return Limits(buckets, address, credential)


def peer_limits(key: str) -> Limits:
    """One bucket at the plain policy, no credential exempt (the SSH gateway's)."""
    return Limits(((key, False),))
