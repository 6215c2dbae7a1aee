"""When the agent renews its lease: at a fixed rate, from when the last renewal was sent.

Sleeping a third of the TTL *after* each answer makes the spacing TTL/3 plus the latency:
when the server is slow every renewal comes later, exactly when the lease has the least
margin. A fixed rate keeps renewals TTL/3 apart however long each took (one that took
longer than the period is followed at once); after a failure the back-off decides.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class RenewalSchedule:
    """The next renewal's due time on a monotonic clock (``now``, injectable for tests)."""

    def __init__(self, period: Callable[[], float],
                 now: Callable[[], float] = time.monotonic) -> None:
        self.period, self.now = period, now
        self.due = now() + period()

    def wait_seconds(self) -> float:
        """How long until the next renewal is due (0: send now)."""
        return max(0.0, self.due - self.now())

    def sending(self) -> float:
        """Note a renewal going out now; returns the time it was sent."""
        return self.now()

    def renewed(self, sent_at: float) -> None:
        """The renewal sent at ``sent_at`` succeeded: the next is a period after it."""
        self.due = sent_at + self.period()

    def retry_in(self, delay: float) -> None:
        """It failed: the next try is ``delay`` from now (the caller's back-off)."""
        self.due = self.now() + delay
