"""The two brakes on declaring nodes Lost, on a manual clock: a fresh TTL for every lease
after a leader change (Nomad), and slowed evictions when most nodes look lost at once
(Kubernetes' 55 %)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpucloud.controllers import loops
from gpucloud.controllers.loops import (
    CATCH_UP_MAX_TTLS,
    CATCH_UP_QUIET_TTLS,
    DISRUPTION_MIN_NODES,
    SLOW_EVICTION_SECONDS,
    NodeLeaseController,
)
from gpucloud.core.clock import ManualClock
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import agent_headers

Register = Callable[..., dict[str, Any]]


def _renew(api: TestClient, node: dict[str, Any]) -> bool:
    """Renew; whether the agent kept its grant (a lapsed lease gets a new one)."""
    response = api.post("/v1/agent/lease", headers=agent_headers(node),
                        json={"fencing_token": node["fencing_token"]})
    assert response.status_code == 200, response.text
    node["fencing_token"] = response.json()["fencing_token"]
    return not response.json()["new_grant"]


def test_a_new_leader_gives_every_lease_a_fresh_ttl(
        api: TestClient, app_ctx: ServiceContext, register_node: Register,
        clock: ManualClock) -> None:
    ttl = app_ctx.settings.lease_ttl_seconds
    back, gone = register_node("back"), register_node("gone")
    controller = NodeLeaseController(app_ctx, startup_grace_seconds=0)
    assert controller.tick() == []
    clock.advance(ttl + 5)  # both lapsed (a failover took longer than the TTL) ...
    controller.on_new_epoch()  # ... and this replica now leads
    assert controller.tick() == []
    clock.advance(ttl - 1)
    # back within the fresh TTL: never declared lost, and its lapsed lease was extended,
    # so it keeps its grant (no new fencing token to refuse its pod reports)
    assert _renew(api, back)
    assert controller.tick() == []
    clock.advance(1)  # the fresh TTL is over: "gone" is given a moment to come back ...
    assert controller.tick() == []
    clock.advance(ttl * CATCH_UP_QUIET_TTLS)  # ... and nothing came back meanwhile
    assert controller.tick() == ["gone"]
    clock.advance(ttl * (1 - CATCH_UP_QUIET_TTLS) - 2)  # back's lease still holds
    assert _renew(api, back)
    assert controller.tick() == []
    assert gone["node_id"] != back["node_id"]


def test_after_a_leader_change_nodes_still_coming_back_hold_evictions(
        api: TestClient, app_ctx: ServiceContext, register_node: Register,
        clock: ManualClock) -> None:
    """The one replica left after a failover is too busy to answer some agents within
    the fresh TTL: while lapsed nodes keep coming back, none is marked; once none has
    for CATCH_UP_QUIET_TTLS, the rest (really gone) are."""
    ttl = app_ctx.settings.lease_ttl_seconds
    late = [register_node(f"late{i}") for i in range(3)]
    register_node("gone")
    controller = NodeLeaseController(app_ctx, startup_grace_seconds=0)
    controller.on_new_epoch()
    assert controller.tick() == []
    clock.advance(ttl)  # nobody got through in the fresh TTL
    assert controller.tick() == []
    step = ttl * CATCH_UP_QUIET_TTLS * 0.8
    back: list[dict[str, Any]] = []
    for node in late:  # one by one they come back, each within the quiet period
        clock.advance(step)
        for earlier in back:  # (and those back renew as usual)
            assert _renew(api, earlier)
        assert not _renew(api, node)  # lapsed: a new grant
        back.append(node)
        assert controller.tick() == []
    clock.advance(step)  # nothing came back for `step` yet: still waiting
    for node in late:
        assert _renew(api, node)
    assert controller.tick() == []
    clock.advance(ttl * CATCH_UP_QUIET_TTLS - step)
    assert controller.tick() == ["gone"]
    for node in late:
        assert _renew(api, node)
    # Caught up: a later loss is marked as soon as its lease lapses.
    clock.advance(ttl)
    for node in late[1:]:
        _renew(api, node)
    assert controller.tick() == ["late0"]


def test_the_fresh_ttl_counts_from_its_refresh_not_from_the_epoch_callback(
        api: TestClient, app_ctx: ServiceContext, register_node: Register,
        clock: ManualClock) -> None:
    """The lease thread refreshes the leases on its next tick, up to a tick after the
    leadership thread's callback. Had the wait counted from the callback, it would end
    before the refreshed leases could lapse, find none lapsed, call the fleet caught up,
    and mark a straggler the moment its lease lapsed (bench/fleet.py: 4 false Lost)."""
    ttl = app_ctx.settings.lease_ttl_seconds
    late = register_node("late")
    controller = NodeLeaseController(app_ctx, startup_grace_seconds=0)
    assert controller.tick() == []
    controller.on_new_epoch()
    clock.advance(0.4)  # the lease thread's next tick
    assert controller.tick() == []
    clock.advance(ttl - 0.4)  # one TTL from the callback, not yet from the refresh
    assert controller.tick() == []
    clock.advance(0.3)
    assert controller.tick() == []
    clock.advance(0.2)  # "late" lapsed now: it gets its chance to come back
    assert controller.tick() == []
    clock.advance(ttl * CATCH_UP_QUIET_TTLS * 0.5)
    assert _renew(api, late) is False  # back, with a new grant
    assert controller.tick() == []


def test_the_catch_up_after_a_leader_change_is_bounded(
        api: TestClient, app_ctx: ServiceContext, register_node: Register,
        clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """However long nodes keep trickling back, a dead node is marked at most
    CATCH_UP_MAX_TTLS TTLs after the leader change."""
    monkeypatch.setattr(loops, "CATCH_UP_QUIET_TTLS", CATCH_UP_MAX_TTLS * 2)
    ttl = app_ctx.settings.lease_ttl_seconds
    late = register_node("late")
    register_node("gone")
    controller = NodeLeaseController(app_ctx, startup_grace_seconds=0)
    controller.on_new_epoch()
    assert controller.tick() == []
    clock.advance(ttl)
    assert controller.tick() == []
    clock.advance(1)
    _renew(api, late)  # one came back: the quiet period starts again
    assert controller.tick() == []
    clock.advance(ttl * (CATCH_UP_MAX_TTLS - 1) - 2)
    _renew(api, late)
    assert controller.tick() == []
    clock.advance(1)
    assert controller.tick() == ["gone"]


def test_evictions_slow_down_when_most_nodes_look_lost(
        api: TestClient, app_ctx: ServiceContext, register_node: Register,
        clock: ManualClock) -> None:
    ttl = app_ctx.settings.lease_ttl_seconds
    fleet = [register_node(f"n{i}") for i in range(DISRUPTION_MIN_NODES)]
    controller = NodeLeaseController(app_ctx, startup_grace_seconds=0)
    clock.advance(ttl + 1)
    for node in fleet[:4]:  # 6 of 10 (60 % > 55 %) look lost: a server-side event
        _renew(api, node)
    assert controller.tick() == []  # the brake engages: nothing at once
    clock.advance(SLOW_EVICTION_SECONDS - 1)
    for node in fleet[:4]:
        _renew(api, node)
    assert controller.tick() == []
    clock.advance(1)
    assert len(controller.tick()) == 1  # one node per SLOW_EVICTION_SECONDS
    assert controller.tick() == []
    # 5 of 9 Ready look lost now (56 %): still braked; the next one a period later.
    clock.advance(SLOW_EVICTION_SECONDS)
    for node in fleet[:4]:
        _renew(api, node)
    assert len(controller.tick()) == 1
    # 4 of 8 (50 %) is under the threshold: the rest are marked at once.
    assert len(controller.tick()) == 4


def test_a_minority_of_lost_nodes_is_marked_at_once(
        api: TestClient, app_ctx: ServiceContext, register_node: Register,
        clock: ManualClock) -> None:
    ttl = app_ctx.settings.lease_ttl_seconds
    fleet = [register_node(f"n{i}") for i in range(DISRUPTION_MIN_NODES)]
    controller = NodeLeaseController(app_ctx, startup_grace_seconds=0)
    clock.advance(ttl + 1)
    for node in fleet[5:]:  # 5 of 10 (50 %): no brake
        _renew(api, node)
    assert sorted(controller.tick()) == [f"n{i}" for i in range(5)]
