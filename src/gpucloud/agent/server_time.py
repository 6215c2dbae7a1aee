"""The server's time as the agent reckons it: what usage samples are stamped with.

The node's wall clock is not trusted. NTP may step it, or it may simply be wrong: a sample
stamped an hour ahead is refused by the server (``core.usage.MAX_FUTURE_SKEW_SECONDS``)
and an hour behind it falls out of the scheduler's load window. Every lease answer carries
the server's time of that renewal (``served_at``); paired with the monotonic clock around
the request it is an *anchor*, and the server's time later is the anchor's plus the
monotonic time since. A step of the node's wall clock changes nothing, as it changes
nothing for the lease itself (agent/renewal.py).

The server stamped the renewal between the request's send and its answer's receipt, so
an anchor stands at the middle of that round trip, uncertain by half of it; an older
anchor grows less certain with age (``DRIFT``: the two clocks' rates may differ). A new
anchor replaces the one held unless it is less certain than that, so a renewal answered
late by a busy server does not drag the time back. Before the first anchor: the wall
clock. A wall clock found more than ``SKEW_REPORT_SECONDS`` off the server's is logged
(a warning: fix the node's time sync), and so is its return.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from gpucloud.core.models import LeaseResponse

log = logging.getLogger(__name__)
#: How fast the server's and the node's monotonic clocks may drift apart (s/s): crystals
#: are within 100 ppm, and an NTP slew of the server's clock is at most 500 ppm.
DRIFT = 5e-4
#: A wall clock this far off the server's (either way) is reported, as is each change of
#: this size and its return.
SKEW_REPORT_SECONDS = 5.0


def served_at(lease: LeaseResponse) -> datetime:
    """The server's time of a renewal: its new expiry less the TTL (services/nodes.py and
    lease_batch.py count the expiry from when the renewal arrived, or was handled)."""
    expires = lease.lease_expires_at
    if expires.tzinfo is None:
        expires = expires.replace(tzinfo=UTC)
    return expires - timedelta(seconds=lease.lease_ttl_seconds)


@dataclass(frozen=True)
class _Anchor:
    server: datetime  # the server's time at ``at``
    at: float  # monotonic
    uncertainty: float  # seconds, either way


class ServerClock:
    """Thread-safe: the lease thread anchors it, the usage thread reads it."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.monotonic, self.wall = monotonic, wall
        self._anchor: _Anchor | None = None
        self._lock = threading.Lock()
        self._reported = 0.0  # the wall clock's skew last logged (0: in step)

    def observe(self, server: datetime, sent: float, received: float) -> None:
        """An answer stamped ``server`` by the server, to a request sent at ``sent`` and
        answered at ``received`` (both on ``monotonic``)."""
        anchor = _Anchor(server, (sent + received) / 2, max(0.0, received - sent) / 2)
        with self._lock:
            held = self._anchor
            if held is None or anchor.uncertainty <= (
                    held.uncertainty + abs(anchor.at - held.at) * DRIFT):
                self._anchor = held = anchor
            skew = (self.wall() - self._at(held, self.monotonic())).total_seconds()
            if abs(skew - self._reported) < SKEW_REPORT_SECONDS:
                return
            reported = self._reported = skew if abs(skew) >= SKEW_REPORT_SECONDS else 0.0
        if reported:
            log.warning("this node's clock is %.1f s %s the server's; usage is stamped with "
                        "the server's time (is the node's time synchronised?)", abs(skew),
                        "ahead of" if skew > 0 else "behind")
        else:
            log.info("this node's clock is in step with the server's again (%+.1f s)", skew)

    def now(self) -> datetime:
        """The server's time now (the wall clock's before any answer came)."""
        with self._lock:
            anchor = self._anchor
        return self.wall() if anchor is None else self._at(anchor, self.monotonic())

    @staticmethod
    def _at(anchor: _Anchor, monotonic: float) -> datetime:
        return anchor.server + timedelta(seconds=monotonic - anchor.at)
