"""Retry pacing: exponential, capped, with jitter so that many agents do not retry in step;
never sooner than the server asked (``Retry-After``)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

#: The longest ``Retry-After`` honoured (seconds): a larger one (a misconfigured proxy) is
#: waited this long, then the agent tries again.
MAX_RETRY_AFTER_S = 60.0
#: A ``Retry-After`` is stretched by a random 0 to this fraction of it: a fleet refused
#: together (every agent told "2") comes back spread over 2–2.5 s, not in one burst.
RETRY_AFTER_JITTER = 0.25


def stop_wait(stop: threading.Event, seconds: float) -> bool:
    """Sleep ``seconds`` unless ``stop`` is set first; True when it was."""
    return stop.wait(seconds)


class Backoff:
    """Delays of ``base * 2**n`` (capped at ``cap``), each scaled by a random 0.5–1.0, and
    at least the server's ``Retry-After`` (bounded, jittered upwards) when it sent one.

    ``sleep(stop, seconds)`` does the waiting (tests pass one that records the delays)."""

    def __init__(self, base: float = 0.2, cap: float = 5.0,
                 sleep: Callable[[threading.Event, float], bool] = stop_wait) -> None:
        self.base = base
        self.cap = cap
        self.failures = 0
        self._sleep = sleep

    def next_delay(self, retry_after: float | None = None) -> float:
        delay = min(self.cap, self.base * 2.0 ** min(self.failures, 30))
        self.failures += 1
        jitter: float = random.uniform(0.5, 1.0)
        if retry_after is None:
            return delay * jitter
        asked = min(max(retry_after, 0.0), MAX_RETRY_AFTER_S)
        return max(delay * jitter, asked * random.uniform(1.0, 1.0 + RETRY_AFTER_JITTER))

    def reset(self) -> None:
        self.failures = 0

    def wait(self, stop: threading.Event, retry_after: float | None = None) -> bool:
        """Sleep the next delay (at least ``retry_after``, see the class) unless ``stop``
        is set first; True when it was."""
        return self._sleep(stop, self.next_delay(retry_after))
