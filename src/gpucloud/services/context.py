"""What every service needs: the database, a clock and the settings."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpucloud.core.clock import Clock
from gpucloud.core.settings import Settings
from gpucloud.db.session import Database
from gpucloud.services.ratelimit import AuthFailureLimiter


class TtlCache:
    """A small thread-safe cache whose entries expire after ``ttl_seconds`` (monotonic).

    Holds what almost every request reads and almost nothing writes (authenticated API
    keys, priority classes), so a request does not pay a query for them: a change on this
    replica clears it at once, one on another replica takes effect within the TTL.
    """

    def __init__(self, ttl_seconds: float = 5.0, max_entries: int = 10_000) -> None:
        self.ttl_seconds = ttl_seconds
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, object]] = {}
        self._lock = threading.Lock()
        #: Tells the other replicas to clear theirs (services/notify.py, on PostgreSQL).
        self.publisher: Callable[[], None] | None = None
        #: Tells the other replicas to forget one key (``forget``; services/notify.py).
        self.key_publisher: Callable[[str], None] | None = None

    def get(self, key: str) -> object | None:
        with self._lock:
            entry = self._entries.get(key)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put(self, key: str, value: object) -> None:
        with self._lock:
            if len(self._entries) >= self.max_entries:
                self._entries.clear()
            self._entries[key] = (time.monotonic() + self.ttl_seconds, value)

    def clear(self) -> None:
        """Forget everything here and, as a hint, on the other replicas."""
        self.clear_local()
        publisher = self.publisher
        if publisher is not None:
            publisher()

    def clear_local(self) -> None:
        with self._lock:
            self._entries.clear()

    def forget(self, key: str) -> None:
        """Forget ``key`` here and, as a hint, on the other replicas: what one entry
        stood for changed (a node's replaced token), and everything else stays cached."""
        self.forget_local(key)
        publisher = self.key_publisher
        if publisher is not None:
            publisher(key)

    def forget_local(self, key: str) -> None:
        with self._lock:
            self._entries.pop(key, None)


@dataclass(frozen=True)
class ServiceContext:
    db: Database
    clock: Clock
    settings: Settings
    cache: TtlCache = field(default_factory=TtlCache)
    #: Failed authentications by client address and key prefix (ratelimit.py).
    auth_failures: AuthFailureLimiter = field(default_factory=AuthFailureLimiter)


_id_lock = threading.Lock()
_last_id_prefix = 0


def new_id() -> str:
    """A 32-hex-digit id that sorts in creation order within a process (like UUIDv7).

    48 bits of milliseconds and a 16-bit counter, strictly increasing, then 64 random
    bits; ordering pods by ``(created_at, id)`` is thus FIFO even when two pods share a
    timestamp (a manual clock in tests, a coarse clock in production).
    """
    global _last_id_prefix
    with _id_lock:
        prefix = max(time.time_ns() // 1_000_000 << 16, _last_id_prefix + 1)
        _last_id_prefix = prefix
    return f"{prefix:016x}{secrets.randbits(64):016x}"


def new_secret(prefix: str) -> str:
    """A high-entropy credential; stored only as its SHA-256 (no salt needed at 256 bits)."""
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, stored_hash: str) -> bool:
    """Whether ``secret`` hashes to ``stored_hash``, compared in constant time.

    Credentials are found by their hash (a unique index, or the cache keyed by it): the
    time such a lookup takes depends on the SHA-256 of what the caller sent, which tells
    an attacker nothing about a real secret's bytes (finding a preimage with a chosen
    hash prefix is the hard problem itself), so the lookup needs no constant-time form.
    The row found is still checked with ``hmac.compare_digest``, so that no code path
    ever accepts a credential on an ordinary ``==`` of secret material.
    """
    return hmac.compare_digest(hash_secret(secret).encode(), stored_hash.encode())
