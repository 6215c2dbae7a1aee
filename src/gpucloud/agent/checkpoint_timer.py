"""The periodic checkpoint request: the pod's signal every τ (Daly's interval, which the
server puts on the assignment as ``checkpoint_interval_seconds``).

The podworker calls ``due`` from its watch loop and sends the signal (``runc kill``) when
it says so; the first request comes one interval after the container started watching,
and a new τ from the server (δ or M moved) counts from the last request. ``request_now``
makes the next call due at once (a drain's checkpoint request). The clock is injectable so
tests need not wait.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class CheckpointTimer:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: float | None = None
        self._now_wanted = threading.Event()
        self.sent = 0

    def due(self, interval: float | None) -> bool:
        """Whether the request is due now, given the current τ (None: never)."""
        now = self._clock()
        if self._last is None:
            self._last = now
        if self._now_wanted.is_set():
            return True
        return interval is not None and interval > 0 and now - self._last >= interval

    def mark_sent(self) -> None:
        self._last = self._clock()
        self._now_wanted.clear()
        self.sent += 1

    def request_now(self) -> None:
        """Make the next ``due`` true (thread-safe: called from the agent's loop)."""
        self._now_wanted.set()
