"""The anchored clock (core/clock.py) and the database's time on a replica (db/clock.py):
readings anchor it, the monotonic clock carries it, a step of the wall clock changes
nothing; the database's clock is read once at start and then on a thread of its own, and
a failed reading keeps the held anchor. Controllable clocks and a fake reading, no sleeps
(but for the thread's, whose readings are waited for)."""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpucloud.core.clock import (
    DRIFT,
    AnchoredClock,
    ManualClock,
    SystemClock,
    real_time,
)
from gpucloud.db.clock import (
    PRECISE_SECONDS,
    RETRY_SECONDS,
    START_READINGS,
    DatabaseClock,
    Reading,
    server_clock,
)
from gpucloud.db.session import Database, default_database_url
from tests.fixtures.clocks import SteppedClocks

#: The reference's time at the first reading; the wall clock starts in step with it.
REFERENCE = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
HOUR = 3600.0


class Clocks(SteppedClocks):
    """This machine's clocks; ``reference`` is the reference's true time, which runs with
    ``tick``; ``read`` reads it in a round trip of ``rtt`` seconds."""

    def __init__(self) -> None:
        super().__init__(REFERENCE)
        self.reference = REFERENCE
        self.rtt = 0.002
        self.reads = 0
        self.fail: Exception | None = None

    def tick(self, seconds: float) -> None:
        super().tick(seconds)
        self.reference += timedelta(seconds=seconds)

    def read(self) -> Reading:
        """The reference read in the middle of a round trip (a fake ``clock_timestamp()``)."""
        self.reads += 1
        if self.fail is not None:
            raise self.fail
        sent = self.mono
        self.tick(self.rtt / 2)
        stamp = self.reference
        self.tick(self.rtt / 2)
        return stamp, sent, self.mono


def test_before_any_reading_it_is_the_wall_clock() -> None:
    clocks = Clocks()
    clocks.step(HOUR)
    assert AnchoredClock(clocks.monotonic, clocks.wall).now() == REFERENCE + timedelta(hours=1)


def test_a_reading_anchors_it_and_steps_of_the_wall_clock_change_nothing() -> None:
    clocks = Clocks()
    clock = AnchoredClock(clocks.monotonic, clocks.wall)
    clock.observe(*clocks.read())
    assert clock.now() == clocks.reference
    assert clock.anchor is not None and clock.anchor.uncertainty == pytest.approx(0.001)
    for step in (HOUR, -2 * HOUR, -HOUR):
        clocks.step(step)
        clocks.tick(5)
        assert clock.now() == clocks.reference != clocks.wall()


def test_a_late_answer_is_no_better_than_the_anchor_held_until_it_has_aged() -> None:
    clocks = Clocks()
    clock = AnchoredClock(clocks.monotonic, clocks.wall)
    clock.observe(*clocks.read())  # within 1 ms
    held = clock.anchor
    clocks.tick(3)
    # Answered in 4 s (so within 2 s), stamped 1 s after the round trip's middle.
    sent = clocks.mono
    clocks.tick(4)
    clock.observe(clocks.reference - timedelta(seconds=1), sent, clocks.mono)
    assert clock.anchor is held and clock.now() == clocks.reference
    clocks.tick(2.5 / DRIFT)  # hours on, the held anchor is the less certain one
    sent = clocks.mono
    clocks.tick(4)
    clock.observe(clocks.reference - timedelta(seconds=1), sent, clocks.mono)
    assert clock.anchor is not held
    assert clock.now() == clocks.reference + timedelta(seconds=1)  # within its 2 s


class Reported(AnchoredClock):
    def __init__(self, clocks: Clocks) -> None:
        super().__init__(clocks.monotonic, clocks.wall)
        self.reports: list[tuple[float, bool]] = []

    def report_skew(self, skew: float, off: bool) -> None:
        self.reports.append((round(skew, 3), off))


def test_a_wall_clock_off_the_references_is_reported_once_each_way() -> None:
    clocks = Clocks()
    clock = Reported(clocks)

    def readings() -> list[tuple[float, bool]]:
        clock.reports.clear()
        for _ in range(3):
            clock.observe(*clocks.read())
            clocks.tick(1)
        return clock.reports

    assert readings() == []
    clocks.step(-4)  # within the tolerance
    assert readings() == []
    clocks.step(-HOUR)
    assert readings() == [(-3604.0, True)]
    clocks.step(2 * HOUR)
    assert readings() == [(3596.0, True)]
    clocks.step(4 - HOUR)
    assert readings() == [(0.0, False)]


def test_clocks_in_real_time_are_those_not_moved_by_hand() -> None:
    clocks = Clocks()
    assert real_time(SystemClock()) and real_time(DatabaseClock(clocks.read))
    assert not real_time(ManualClock())


def _database_clock(clocks: Clocks, interval: float = 10.0) -> DatabaseClock:
    return DatabaseClock(clocks.read, interval, clocks.monotonic, clocks.wall)


def test_the_database_clock_is_the_databases_time_whatever_the_replicas_says() -> None:
    clocks = Clocks()
    clocks.step(-HOUR)  # this replica's clock is an hour behind
    clock = _database_clock(clocks)
    assert clock.refresh()
    assert clock.now() == clocks.reference
    clocks.tick(7.5)
    clocks.step(2 * HOUR)  # stepped to an hour ahead between readings
    assert clock.now() == clocks.reference
    assert clock.refresh() and clock.now() == clocks.reference


def test_a_stalled_first_reading_is_replaced_at_once_and_read_again_soon() -> None:
    """At start the most certain of a few readings is kept; while the anchor held is
    less certain than ``PRECISE_SECONDS`` (or a reading failed) the next comes after
    ``RETRY_SECONDS``, not the interval."""
    clocks = Clocks()
    clock = _database_clock(clocks)
    assert clock.pause() == RETRY_SECONDS  # none yet
    clocks.rtt = 3.0  # the replica stalled mid-reading: off by up to 1.5 s
    assert clock.refresh() and clock.pause() == RETRY_SECONDS
    clocks.rtt = 0.002
    assert clock.first_readings() and clocks.reads == 1 + START_READINGS
    anchor = clock.anchor
    assert anchor is not None and anchor.uncertainty <= PRECISE_SECONDS
    assert clock.pause() == 10.0
    clocks.fail = OSError("gone")
    assert not clock.refresh() and clock.pause() == RETRY_SECONDS
    assert not clock.first_readings() and clocks.reads == 3 + START_READINGS  # stops at once


def test_a_failed_reading_keeps_the_anchor_and_is_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "gpucloud.db.clock")
    clocks = Clocks()
    clock = _database_clock(clocks)
    clocks.fail = OSError("connection refused")
    assert not clock.refresh() and clock.now() == clocks.wall()  # none yet: the wall clock
    clocks.fail = None
    assert clock.refresh()
    anchor = clock.anchor
    clocks.fail = OSError("server closed the connection")
    for _ in range(3):
        clocks.tick(10)
        assert not clock.refresh()
    assert clock.anchor is anchor and clock.now() == clocks.reference
    clocks.fail = None
    assert clock.refresh() and clock.anchor is not anchor
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "could not read the database's clock (keeping the time anchored to "
                    "none yet): connection refused"),
        ("INFO", "the database's clock is read again"),
        ("WARNING", "could not read the database's clock (keeping the time anchored "
                    "before): server closed the connection"),
        ("INFO", "the database's clock is read again")]


def test_a_replica_clock_off_the_databases_is_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "gpucloud.db.clock")
    clocks = Clocks()
    clocks.step(-HOUR)
    clock = _database_clock(clocks)
    clock.refresh()
    clock.refresh()
    clocks.step(HOUR)
    clock.refresh()
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "this replica's clock is 3600.0 s behind the database's; the server "
                    "keeps the database's time (is this host's time synchronised?)"),
        ("INFO", "this replica's clock is in step with the database's again (+0.0 s)")]


def test_started_it_reads_again_every_interval_until_stopped() -> None:
    """The thread's readings (real waits of 10 ms); ``stop`` ends them and closes."""
    clocks = Clocks()
    lock = threading.Lock()
    three = threading.Event()
    closed: list[bool] = []

    def read() -> Reading:
        with lock:
            reading = clocks.read()
            if clocks.reads >= 3:
                three.set()
            return reading

    clock = DatabaseClock(read, 0.01, clocks.monotonic, clocks.wall,
                          close=lambda: closed.append(True))
    clock.refresh()  # the first, at start, by the caller
    clock.start()
    assert three.wait(10)
    clock.stop()
    with lock:
        reads = clocks.reads
    assert closed == [True]
    three.wait(0.05)
    assert clocks.reads == reads  # no reading after stop


def test_sqlite_keeps_the_system_clock(tmp_path: Path) -> None:
    db = Database(default_database_url(tmp_path))
    try:
        assert type(server_clock(db)) is SystemClock
    finally:
        db.dispose()
