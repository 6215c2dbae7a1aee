"""The two brakes on declaring nodes Lost, on a manual clock: a fresh TTL for every lease
after a leader change (Nomad), and slowed evictions when most nodes look lost at once
(Kubernetes' 55 %)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from gpucloud.controllers.loops import (
    DISRUPTION_MIN_NODES,
    SLOW_EVICTION_SECONDS,
    NodeLeaseController,
)
from gpucloud.core.clock import ManualClock
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import agent_headers

Register = Callable[..., dict[str, Any]]


def _renew(api: TestClient, node: dict[str, Any]) -> None:
    response = api.post("/v1/agent/lease", headers=agent_headers(node),
                        json={"fencing_token": node["fencing_token"]})
    assert response.status_code == 200, response.text
    node["fencing_token"] = response.json()["fencing_token"]  # a lapsed lease: new grant


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
    _renew(api, back)  # back within the fresh TTL: never declared lost
    assert controller.tick() == []
    clock.advance(1)
    assert controller.tick() == ["gone"]
    clock.advance(ttl / 2)
    _renew(api, back)
    assert controller.tick() == []
    assert gone["node_id"] != back["node_id"]


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
