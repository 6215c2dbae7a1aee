"""Time as a dependency, so controllers and tests never wait on the wall clock.

``AnchoredClock`` is another machine's clock as this one reckons it: the agent's view of
the server's time (agent/server_time.py), a server replica's view of the database's
(db/clock.py). Each reading of the reference clock, paired with this machine's monotonic
clock around the round trip that fetched it, is an *anchor*; the reference's time later is
the anchor's plus the monotonic time since. A step of this machine's wall clock changes
nothing.

The reference stamped its reading between the request's send and its answer's receipt,
so an anchor stands at the middle of that round trip, uncertain by half of it; an older
anchor grows less certain with age (``DRIFT``: the two clocks' rates may differ). A new
anchor replaces the one held unless it is less certain than that, so an answer that came
back late does not drag the time back. Before the first anchor: the wall clock. A wall
clock found more than ``SKEW_REPORT_SECONDS`` off the reference's is logged (a warning
in the subclass's words), and so is its return.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol

#: How fast two machines' monotonic clocks may drift apart (s/s): crystals are within
#: 100 ppm, and an NTP slew of the reference's clock is at most 500 ppm.
DRIFT = 5e-4
#: A wall clock this far off the reference's (either way) is reported, as is each change
#: of this size and its return.
SKEW_REPORT_SECONDS = 5.0


class Clock(Protocol):
    def now(self) -> datetime: ...


def utc_now() -> datetime:
    """The wall clock, in UTC."""
    return datetime.now(UTC)


class SystemClock:
    def now(self) -> datetime:
        return utc_now()


class ManualClock:
    """A clock that moves only when told to; thread-safe."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2026, 1, 1, tzinfo=UTC)
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> datetime:
        with self._lock:
            self._now += timedelta(seconds=seconds)
            return self._now


@dataclass(frozen=True)
class Anchor:
    reference: datetime  # the reference clock's time at ``at``
    at: float  # monotonic
    uncertainty: float  # seconds, either way

    def time_at(self, monotonic: float) -> datetime:
        return self.reference + timedelta(seconds=monotonic - self.at)


class AnchoredClock:
    """A reference clock's time, anchored by readings of it (see the module).
    Thread-safe: one thread anchors it, any reads it."""

    #: How ``report_skew`` names this machine, the reference, what follows from the skew
    #: and whose time sync to check; logged by the subclass's module's logger.
    here, there, consequence, host = "this machine", "the reference", "", "this host"

    def __init__(self, monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime] = utc_now) -> None:
        self.monotonic, self.wall = monotonic, wall
        self._anchor: Anchor | None = None
        self._lock = threading.Lock()
        self._reported = 0.0  # the wall clock's skew last reported (0: in step)

    @property
    def anchor(self) -> Anchor | None:
        return self._anchor

    def observe(self, reference: datetime, sent: float, received: float) -> None:
        """A reading ``reference`` of the reference clock, asked for at ``sent`` and
        answered at ``received`` (both on ``monotonic``)."""
        anchor = Anchor(reference, (sent + received) / 2, max(0.0, received - sent) / 2)
        with self._lock:
            held = self._anchor
            if held is None or anchor.uncertainty <= (
                    held.uncertainty + abs(anchor.at - held.at) * DRIFT):
                self._anchor = held = anchor
            skew = (self.wall() - held.time_at(self.monotonic())).total_seconds()
            if abs(skew - self._reported) < SKEW_REPORT_SECONDS:
                return
            off = abs(skew) >= SKEW_REPORT_SECONDS
            self._reported = skew if off else 0.0
        self.report_skew(skew, off)

    def report_skew(self, skew: float, off: bool) -> None:
        """The wall clock is ``skew`` seconds ahead of the reference's (behind when
        negative): ``off`` (beyond ``SKEW_REPORT_SECONDS``, a warning), or in step again."""
        log = logging.getLogger(type(self).__module__)
        if off:
            log.warning("%s's clock is %.1f s %s %s's; %s (is %s's time synchronised?)",
                        self.here, abs(skew), "ahead of" if skew > 0 else "behind",
                        self.there, self.consequence, self.host)
        else:
            log.info("%s's clock is in step with %s's again (%+.1f s)", self.here,
                     self.there, skew)

    def now(self) -> datetime:
        """The reference's time now (the wall clock's before the first anchor)."""
        anchor = self._anchor  # one immutable object: read whole without the lock
        return self.wall() if anchor is None else anchor.time_at(self.monotonic())


def real_time(clock: Clock) -> bool:
    """Whether ``clock`` runs in real time (the system's, or a reference's carried by the
    monotonic clock), not moved by hand as a test's is."""
    return isinstance(clock, SystemClock | AnchoredClock)
