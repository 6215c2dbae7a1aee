"""Retry pacing: exponential, capped, with jitter so that many agents do not retry in step."""

from __future__ import annotations

import random
import threading


class Backoff:
    """Delays of ``base * 2**n`` (capped at ``cap``), each scaled by a random 0.5–1.0."""

    def __init__(self, base: float = 0.2, cap: float = 5.0) -> None:
        self.base = base
        self.cap = cap
        self.failures = 0

    def next_delay(self) -> float:
        delay = min(self.cap, self.base * 2.0 ** min(self.failures, 30))
        self.failures += 1
        jitter: float = random.uniform(0.5, 1.0)
        return delay * jitter

    def reset(self) -> None:
        self.failures = 0

    def wait(self, stop: threading.Event) -> bool:
        """Sleep the next delay unless ``stop`` is set first; True when it was."""
        return stop.wait(self.next_delay())
