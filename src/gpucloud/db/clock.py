"""A server replica's time is the database's (issue 16: leases use the database's clock).

Every time a replica writes (a node lease's expiry, a pod's ``created_at``, an event, a
billing phase) comes from the service clock, and the leader compares node leases with its
own. On each replica's wall clock, a replica whose clock is off (stepped back an hour, or
simply skewed) wrote expiries the leader saw as long past (a false ``Lost``) or far ahead
(a dead node never found). So on PostgreSQL the service clock is ``DatabaseClock``: the
database server's ``clock_timestamp()``, read on a connection of its own (not the request
pool: a reading never waits for a busy replica's requests) at start, before anything is
written, then every ``READ_INTERVAL_SECONDS`` on a thread of its own, and carried between
readings by the monotonic clock (``core.clock.AnchoredClock``, as the agent carries the
server's time). Every replica is then on the one timeline, within half the round trip of
its best reading (loopback or a LAN: well under a millisecond) plus ``DRIFT`` (500 ppm) of
its age: a few milliseconds, whatever the replicas' wall clocks say.

A reading that took long (the replica's process stalled between asking and hearing: it
may be off by up to half that) is kept only until a quicker one: the clock is read
``START_READINGS`` times at start, and again after ``RETRY_SECONDS`` while the anchor is
less certain than ``PRECISE_SECONDS``. A failed reading keeps the anchor held (logged once
until one succeeds; retried after ``RETRY_SECONDS``). A wall clock more than
``SKEW_REPORT_SECONDS`` off the database's is logged (a warning: fix the host's time sync),
and so is its return. SQLite (one server) keeps the system clock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

from sqlalchemy import text

from gpucloud.core.clock import AnchoredClock, Clock, SystemClock, utc_now
from gpucloud.db.session import Database, make_engine

log = logging.getLogger(__name__)
#: Seconds between readings of the database's clock.
READ_INTERVAL_SECONDS = 10.0
#: An anchor this certain (s, either way) waits ``READ_INTERVAL_SECONDS`` for the next
#: reading; a less certain one (a reading stalled in a busy replica) or none (a failed
#: reading) only ``RETRY_SECONDS``.
PRECISE_SECONDS = 0.05
RETRY_SECONDS = 1.0
#: Readings at start, the most certain kept: one stalled start-up does not set the clock.
START_READINGS = 3
#: A reading: the database's ``clock_timestamp()``, and the monotonic times at which it
#: was asked for and answered.
Reading = tuple[datetime, float, float]


class ClockReader:
    """``SELECT clock_timestamp()`` on a connection of its own (a pool of one)."""

    def __init__(self, url: str, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.monotonic = monotonic
        self.engine = make_engine(url, pool_size=1, pool_timeout=5,
                                  connect_args={"connect_timeout": 5})

    def __call__(self) -> Reading:
        with self.engine.connect() as connection:
            auto = connection.execution_options(isolation_level="AUTOCOMMIT")  # no BEGIN
            sent = self.monotonic()
            value = auto.scalar(text("SELECT clock_timestamp()"))
            received = self.monotonic()
        if not isinstance(value, datetime):
            raise TypeError(f"clock_timestamp() gave {value!r}")
        return (value if value.tzinfo else value.replace(tzinfo=UTC)), sent, received

    def close(self) -> None:
        self.engine.dispose()


class DatabaseClock(AnchoredClock):
    """The database's time on this replica (see the module): ``refresh`` reads it,
    ``start`` keeps reading it every ``interval`` seconds until ``stop``."""

    here, there, host = "this replica", "the database", "this host"
    consequence = "the server keeps the database's time"

    def __init__(self, read: Callable[[], Reading], interval: float = READ_INTERVAL_SECONDS,
                 monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime] = utc_now,
                 close: Callable[[], None] | None = None) -> None:
        super().__init__(monotonic, wall)
        self.read, self.interval, self._close = read, interval, close
        self._failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def of(cls, url: str) -> DatabaseClock:
        """The clock of the PostgreSQL database at ``url``, read already (``START_READINGS``
        times, or until one failed)."""
        reader = ClockReader(url)
        clock = cls(reader, monotonic=reader.monotonic, close=reader.close)
        clock.first_readings()
        return clock

    def first_readings(self) -> bool:
        """The readings at start: ``START_READINGS``, the most certain kept, or until one
        failed; whether they all answered."""
        return all(self.refresh() for _ in range(START_READINGS))

    def refresh(self) -> bool:
        """Read the database's clock once; whether it answered (if not, the anchor held
        stays)."""
        try:
            reference, sent, received = self.read()
        except Exception as error:  # noqa: BLE001 - any failure: keep the held anchor
            if not self._failing:
                log.warning("could not read the database's clock (keeping the time "
                            "anchored %s): %s", "before" if self.anchor else "to none yet",
                            error)
            self._failing = True
            return False
        self.observe(reference, sent, received)
        if self._failing:
            log.info("the database's clock is read again")
        self._failing = False
        return True

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="database-clock",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._close is not None:
            self._close()

    def pause(self) -> float:
        """Seconds until the next reading: ``interval`` while the anchor held is precise,
        else (none, or a reading that took long) at most ``RETRY_SECONDS``."""
        anchor = self.anchor
        if anchor is not None and anchor.uncertainty <= PRECISE_SECONDS and not self._failing:
            return self.interval
        return min(self.interval, RETRY_SECONDS)

    def _run(self) -> None:
        while not self._stop.wait(self.pause()):
            self.refresh()


def server_clock(db: Database) -> Clock:
    """A server's service clock: the database's on PostgreSQL, the system's on SQLite."""
    return SystemClock() if db.is_sqlite else DatabaseClock.of(db.url)
