"""The server's clock jumping (issue 16's fault list), on a manual wall clock beside a
manual monotonic one, on SQLite and PostgreSQL.

Invariants: a jump forward (a clock set ahead, a suspended VM) marks no healthy node Lost
and brings no new grants (the agents keep their fencing tokens); a jump backward neither
keeps a dead node's lease alive until the old time comes round again, nor holds the
disruption brake that long; a node that really stopped is still found within a TTL.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpucloud.controllers.loops import (
    DISRUPTION_MIN_NODES,
    SLOW_EVICTION_SECONDS,
    NodeLeaseController,
)
from gpucloud.core.clock import ManualClock
from gpucloud.db.clock import DatabaseClock, Reading
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import agent_headers

Register = Callable[..., dict[str, Any]]
HOUR = 3600.0


class Monotonic:
    """The monotonic clock beside the manual wall clock: moves only when time passes."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds


def _pass(clock: ManualClock, mono: Monotonic, seconds: float) -> None:
    clock.advance(seconds)
    mono.seconds += seconds


def _renew(api: TestClient, node: dict[str, Any]) -> bool:
    """Renew; whether the agent kept its grant (no new fencing token)."""
    response = api.post("/v1/agent/lease", headers=agent_headers(node),
                        json={"fencing_token": node["fencing_token"]})
    assert response.status_code == 200, response.text
    node["fencing_token"] = response.json()["fencing_token"]
    return not response.json()["new_grant"]


def test_a_forward_jump_marks_no_healthy_node_lost(
        api: TestClient, app_ctx: ServiceContext, register_node: Register,
        clock: ManualClock) -> None:
    ttl = app_ctx.settings.lease_ttl_seconds
    alive = register_node("alive")
    register_node("dead")
    mono = Monotonic()
    controller = NodeLeaseController(app_ctx, startup_grace_seconds=0, monotonic=mono)
    assert controller.tick() == []
    _pass(clock, mono, ttl / 2)
    assert _renew(api, alive)  # "dead" stops renewing here
    assert controller.tick() == []
    clock.advance(HOUR)  # the clock is set an hour ahead (or the VM slept an hour)
    assert controller.tick() == []  # neither is declared Lost on the jump
    assert _renew(api, alive)  # and the healthy agent keeps its grant and token
    _pass(clock, mono, ttl / 2)
    assert _renew(api, alive)
    assert controller.tick() == []
    _pass(clock, mono, ttl / 2)
    assert controller.tick() == ["dead"]  # the dead one within a TTL of the jump
    assert api.get("/v1/nodes/alive").json()["status"] == "Ready"


def test_a_backward_jump_neither_hides_a_dead_node_nor_holds_the_brake(
        api: TestClient, app_ctx: ServiceContext, register_node: Register,
        clock: ManualClock) -> None:
    ttl = app_ctx.settings.lease_ttl_seconds
    fleet = [register_node(f"n{i}") for i in range(DISRUPTION_MIN_NODES)]
    mono = Monotonic()
    controller = NodeLeaseController(app_ctx, startup_grace_seconds=0, monotonic=mono)
    _pass(clock, mono, ttl + 1)
    for node in fleet[:4]:  # 6 of 10 look lost: the brake engages
        _renew(api, node)
    assert controller.tick() == []
    clock.advance(-HOUR)  # the clock is set an hour back
    for node in fleet[:4]:
        assert _renew(api, node)
    assert controller.tick() == []  # the jump: every lease gets one TTL from the new time
    _pass(clock, mono, ttl / 2)
    for node in fleet[:4]:
        assert _renew(api, node)
    assert controller.tick() == []
    # Without the rebase the six dead leases would run for another hour.
    _pass(clock, mono, ttl / 2 + 1)
    for node in fleet[:4]:
        assert _renew(api, node)
    assert controller.tick() == []  # 6 of 10 lapsed: the brake engages again ...
    for _ in range(2):
        for _ in range(round(SLOW_EVICTION_SECONDS / (ttl / 2))):  # the live four renew
            _pass(clock, mono, ttl / 2)
            for node in fleet[:4]:
                assert _renew(api, node)
        assert len(controller.tick()) == 1  # ... one per period, on the new time
    assert len(controller.tick()) == 4  # 4 of 8: under the threshold, the rest at once
    assert all(api.get(f"/v1/nodes/n{i}").json()["status"] == "Ready" for i in range(4))


def test_small_steps_of_the_clock_are_no_jump(
        api: TestClient, app_ctx: ServiceContext, register_node: Register,
        clock: ManualClock) -> None:
    ttl = app_ctx.settings.lease_ttl_seconds
    register_node("gone")
    mono = Monotonic()
    controller = NodeLeaseController(app_ctx, startup_grace_seconds=0, monotonic=mono)
    assert controller.tick() == []
    _pass(clock, mono, ttl - 1)
    clock.advance(ttl / 4)  # an NTP step well under half a TTL: no rebase
    assert controller.tick() == ["gone"]


def test_corrections_of_the_database_clock_are_no_jump(
        api: TestClient, app_ctx: ServiceContext, register_node: Register,
        clock: ManualClock, caplog: pytest.LogCaptureFixture) -> None:
    """A replica's clock on PostgreSQL is the database's (db/clock.py), carried by the
    monotonic clock between readings, each of which corrects it a little (here 0.2 s
    either way, each time: far more than a real round trip's). The lease controller
    watches it for jumps as it does the system clock, sees none, rebases nothing, and
    finds a dead node within its TTL, whatever the replica's wall clock says."""
    ttl = app_ctx.settings.lease_ttl_seconds
    alive = register_node("alive")
    register_node("gone")
    mono = Monotonic()
    errors = itertools.cycle((0.2, -0.2))

    def read() -> Reading:
        return clock.now() + timedelta(seconds=next(errors)), mono(), mono()

    database = DatabaseClock(read, monotonic=mono,
                             wall=lambda: clock.now() - timedelta(hours=1))
    ctx = replace(app_ctx, clock=database)
    assert NodeLeaseController(ctx)._monotonic is time.monotonic  # in real time: watched
    controller = NodeLeaseController(ctx, startup_grace_seconds=0, monotonic=mono)
    caplog.set_level(logging.WARNING, "gpucloud.controllers.loops")
    assert database.refresh() and controller.tick() == []
    lost: dict[str, float] = {}
    for second in range(1, round(2 * ttl) + 1):
        _pass(clock, mono, 1)
        assert database.refresh()
        assert _renew(api, alive)
        lost |= dict.fromkeys(controller.tick(), second)
    assert lost == {"gone": ttl}
    assert "jumped" not in caplog.text
