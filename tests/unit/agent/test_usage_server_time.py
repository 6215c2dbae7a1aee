"""Usage samples carry the server's time as the agent reckons it (agent/server_time.py):
lease answers anchor it, the monotonic clock carries it forward, and a step of the node's
wall clock changes nothing. Controllable clocks, no sleeps."""

from __future__ import annotations

import json
import logging
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from gpucloud.agent.connection import Connection
from gpucloud.agent.identity import IdentityFile
from gpucloud.agent.server_time import ServerClock, served_at
from gpucloud.core.clock import DRIFT
from gpucloud.core.models import LeaseResponse, NodeRegisterRequest
from tests.fixtures.clocks import SteppedClocks

#: The server's time at the first answer; the node's wall clock starts in step with it.
SERVER = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
HOUR = 3600.0


class Clocks(SteppedClocks):
    """The node's clocks, its wall clock in step with the server's at first."""

    def __init__(self) -> None:
        super().__init__(SERVER)

    def server_clock(self) -> ServerClock:
        return ServerClock(self.monotonic, self.wall)


def _answer(clock: ServerClock, clocks: Clocks, server: datetime, rtt: float) -> None:
    """A request sent now, stamped ``server`` by the server, answered ``rtt`` later."""
    sent = clocks.monotonic()
    clocks.tick(rtt)
    clock.observe(server, sent, clocks.monotonic())


def test_before_any_answer_it_is_the_wall_clock() -> None:
    clocks = Clocks()
    clocks.step(HOUR)
    assert clocks.server_clock().now() == SERVER + timedelta(hours=1)


def test_an_answer_anchors_it_and_steps_of_the_wall_clock_change_nothing() -> None:
    clocks = Clocks()
    clock = clocks.server_clock()
    _answer(clock, clocks, SERVER, rtt=0.2)  # stamped mid-way: the anchor is at +0.1
    assert clock.now() == SERVER + timedelta(seconds=0.1)
    for step in (HOUR, -2 * HOUR, -HOUR):  # ahead, behind, further behind
        clocks.step(step)
        clocks.tick(5)
        assert clocks.wall() != clock.now()
    assert clock.now() == SERVER + timedelta(seconds=15.1)  # monotonic time since


def test_the_most_certain_anchor_is_kept_until_its_age_makes_it_less_so() -> None:
    clocks = Clocks()
    clock = clocks.server_clock()
    _answer(clock, clocks, SERVER, rtt=0.002)  # SERVER at 100.001, within 1 ms
    clocks.tick(3)
    # A busy server answers in 4 s (so within 2 s), stamped 1 s off the round trip's
    # middle: less certain than the held anchor aged 3 s, it is not taken.
    _answer(clock, clocks, clock.now() + timedelta(seconds=1), rtt=4)
    assert clock.now() == SERVER + timedelta(seconds=7.001)
    # Hours later the held anchor is the less certain one: the same answer is taken.
    clocks.tick(2.5 / DRIFT)
    _answer(clock, clocks, clock.now() + timedelta(seconds=1), rtt=4)
    assert clock.now() == SERVER + timedelta(seconds=7.001 + 2.5 / DRIFT + 3)
    # A quick answer is taken at once: a step of the server's own clock is followed.
    _answer(clock, clocks, SERVER, rtt=0.002)
    assert clock.now() == SERVER + timedelta(seconds=0.001)


def test_a_wall_clock_off_the_servers_is_logged_once_each_way(
        caplog: pytest.LogCaptureFixture) -> None:
    clocks = Clocks()
    clock = clocks.server_clock()

    def renewals(count: int = 3) -> list[str]:
        caplog.clear()
        for _ in range(count):
            _answer(clock, clocks, clock.now() + timedelta(seconds=0.001), rtt=0.002)
            clocks.tick(1)
        return [f"{r.levelname} {r.getMessage()}" for r in caplog.records]

    caplog.set_level(logging.INFO, "gpucloud.agent.server_time")
    assert renewals() == []
    clocks.step(2)  # within the tolerance: not worth a word
    assert renewals() == []
    clocks.step(HOUR)
    [ahead] = renewals()
    assert ahead.startswith("WARNING this node's clock is 3602.0 s ahead of the server's")
    clocks.step(-2 * HOUR)
    [behind] = renewals()
    assert behind.startswith("WARNING this node's clock is 3598.0 s behind the server's")
    clocks.step(HOUR - 2)
    assert renewals() == ["INFO this node's clock is in step with the server's again "
                          "(+0.0 s)"]


def test_a_lease_answer_is_stamped_its_expiry_less_the_ttl() -> None:
    expires = SERVER + timedelta(seconds=30)
    assert served_at(LeaseResponse(fencing_token=1, lease_expires_at=expires,
                                   lease_ttl_seconds=30, new_grant=False)) == SERVER
    naive = LeaseResponse(fencing_token=1, lease_expires_at=expires.replace(tzinfo=None),
                          lease_ttl_seconds=30, new_grant=True)
    assert served_at(naive) == SERVER  # read as UTC


def test_the_connections_lease_answers_anchor_its_clock(tmp_path: Path) -> None:
    """Registration, then renewals: each answer (0.2 s on the way) anchors the clock the
    agent stamps samples with, whatever the node's wall clock says."""
    clocks = Clocks()
    clocks.step(HOUR)  # the node starts an hour ahead

    def server(request: httpx.Request) -> httpx.Response:
        clocks.tick(0.1)  # on the way there, then back
        now = SERVER + timedelta(seconds=clocks.monotonic() - 100.0)
        clocks.tick(0.1)
        if request.url.path == "/v1/agent/register":
            return httpx.Response(200, json={
                "node_id": "n-1", "name": "n1", "node_token": "gpn_x", "fencing_token": 1,
                "lease_ttl_seconds": 30})
        body = json.loads(request.content)
        return httpx.Response(200, json={
            "fencing_token": body["fencing_token"] or 2,
            "lease_expires_at": (now + timedelta(seconds=30)).isoformat(),
            "lease_ttl_seconds": 30, "new_grant": body["fencing_token"] is None})

    registration = NodeRegisterRequest(join_token="gpj_x", name="n1", cpu_cores=1,
                                       memory_bytes=1 << 30, gpus=[])
    conn = Connection("http://server", registration, IdentityFile(tmp_path),
                      threading.Event(), transport=httpx.MockTransport(server),
                      server_clock=clocks.server_clock())
    try:
        conn.connect()
        assert conn.server_clock.now() == clocks.wall()  # no lease answer yet
        conn.renew()
        assert conn.server_clock.now() == SERVER + timedelta(seconds=0.4)
        clocks.tick(10)
        clocks.step(-2 * HOUR)  # now an hour behind
        conn.reacquire()
        assert conn.fencing_token == 2
        assert conn.server_clock.now() == SERVER + timedelta(seconds=10.6)
    finally:
        conn.close()
