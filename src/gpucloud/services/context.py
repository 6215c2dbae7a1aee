"""What every service needs: the database, a clock and the settings."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass

from gpucloud.core.clock import Clock
from gpucloud.core.settings import Settings
from gpucloud.db.session import Database


@dataclass(frozen=True)
class ServiceContext:
    db: Database
    clock: Clock
    settings: Settings


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
