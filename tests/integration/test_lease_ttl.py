"""The fleet's lease TTL (services/lease_ttl.py): the configured one for a small fleet,
longer for one whose renewals every TTL/3 would pass ``GPUCLOUD_LEASE_RATE`` a second;
granted on every path, and a dead node still found Lost within its own TTL. And its
long-poll wait: none asked of a small fleet, a longer one (at most the route's bound) of
one whose polls would pass ``GPUCLOUD_POLL_RATE`` a second, in every poll's answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from gpucloud.agent.config import poll_wait
from gpucloud.api import lease_capacity
from gpucloud.controllers.loops import NodeLeaseController
from gpucloud.core.clock import ManualClock
from gpucloud.core.models import (
    MAX_POLL_WAIT_SECONDS,
    LeaseRequest,
    LeaseResponse,
    NodeRegisterRequest,
)
from gpucloud.db.models import NodeModel
from gpucloud.services import join_tokens, lease_batch, lease_ttl, nodes, projects
from gpucloud.services.context import ServiceContext
from tests.conftest import ADMIN_KEY
from tests.integration.conftest import agent_headers


def test_the_ttl_grows_only_past_the_rate_and_in_whole_seconds() -> None:
    assert lease_ttl.fleet_ttl(10.0, 0, 1000) == 10.0
    assert lease_ttl.fleet_ttl(10.0, 3333, 1000) == 10.0  # 3,333 renewals per 10/3 s
    assert lease_ttl.fleet_ttl(10.0, 3334, 1000) == 11.0  # 10.002 s: the next second
    assert lease_ttl.fleet_ttl(10.0, 10_000, 1000) == 30.0  # 1,000 renewals/s
    assert lease_ttl.fleet_ttl(60.0, 10_000, 1000) == 60.0  # a longer base stands
    assert lease_ttl.fleet_ttl(2.5, 1, 1000) == 2.5  # a short test TTL is kept as it is


def test_the_poll_wait_grows_only_past_the_rate_and_within_the_routes_bound() -> None:
    assert lease_ttl.fleet_poll_wait(0, 200) is None
    assert lease_ttl.fleet_poll_wait(6000, 200) is None  # 30 s waits: 200 polls/s
    assert lease_ttl.fleet_poll_wait(6001, 200) == 31.0  # the next whole second
    assert lease_ttl.fleet_poll_wait(10_000, 200) == 50.0
    assert lease_ttl.fleet_poll_wait(50_000, 200) == lease_ttl.MAX_POLL_WAIT == 60.0
    assert lease_ttl.MAX_POLL_WAIT == MAX_POLL_WAIT_SECONDS  # the agent's bound, the same


def test_the_agent_polls_with_the_longer_wait_within_the_bound() -> None:
    assert poll_wait(30.0, None) == 30.0
    assert poll_wait(0.5, None) == 0.5  # a small fleet: a test's short wait stands
    assert poll_wait(30.0, 50.0) == 50.0
    assert poll_wait(55.0, 40.0) == 55.0  # never shorter than its own
    assert poll_wait(30.0, 600.0) == MAX_POLL_WAIT_SECONDS


def _poll(api: TestClient, reg: dict[str, Any], **params: Any) -> dict[str, Any]:
    response = api.get("/v1/agent/assignments", headers=agent_headers(reg), params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_a_large_fleet_is_asked_for_longer_polls_in_every_answer(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    regs = [register_node(f"gpu-{i}") for i in range(5)]
    lease_ttl.forget(app_ctx.db)
    lease_ttl.current(app_ctx)  # counted now: 5 Ready nodes
    first = _poll(api, regs[0])  # built and kept at the default rate: nothing asked
    assert first["poll_wait_seconds"] is None
    monkeypatch.setattr(lease_ttl, "POLL_RATE", 0.125)  # 5 nodes: 40 s waits
    # a poll ending on its unchanged revision: the answer kept at another count, asking
    kept = _poll(api, regs[0], revision=first["revision"], wait=0.01)
    assert kept["revision"] == first["revision"] and kept["poll_wait_seconds"] == 40.0
    assert _poll(api, regs[1])["poll_wait_seconds"] == 40.0  # one built afresh
    monkeypatch.setattr(lease_ttl, "POLL_RATE", 0.0625)  # 80 s: the route's bound
    assert _poll(api, regs[2])["poll_wait_seconds"] == lease_ttl.MAX_POLL_WAIT


def _register(ctx: ServiceContext, count: int) -> list[str]:
    projects.bootstrap_admin(ctx)
    admin = projects.authenticate(ctx, ADMIN_KEY)
    tokens = []
    for i in range(count):
        token = join_tokens.create(ctx, admin).token
        tokens.append(nodes.register_node(ctx, NodeRegisterRequest(
            join_token=token, name=f"n{i}", cpu_cores=8, memory_bytes=2**34,
            gpus=[])).node_token)
    return tokens


@pytest.fixture
def small_rate(monkeypatch: pytest.MonkeyPatch, ctx: ServiceContext) -> float:
    """Two renewals a second: 12 nodes renewing every TTL/3 need an 18 s TTL."""
    monkeypatch.setattr(lease_ttl, "RATE", 2.0)
    lease_ttl.forget(ctx.db)
    return 18.0


def test_a_large_fleet_is_granted_the_longer_ttl_on_every_path(
    ctx: ServiceContext, clock: ManualClock, small_rate: float,
) -> None:
    assert ctx.settings.lease_ttl_seconds < small_rate
    tokens = _register(ctx, 12)
    lease_ttl.forget(ctx.db)  # count the fleet now (else: within RECOUNT_S)
    assert lease_ttl.current(ctx) == small_rate
    assert lease_ttl.cached(ctx) == small_rate
    # a registration (a node re-registering)
    again = _register(ctx, 1)
    with ctx.db.read() as session:
        node = session.scalars(select(NodeModel).where(NodeModel.name == "n0")).one()
    assert node.lease_expires_at == clock.now() + timedelta(seconds=small_rate)
    # the batched hot path
    clock.advance(1)
    [batched] = lease_batch.renew_many(
        ctx, [lease_batch.Renewal(tokens[1], LeaseRequest(fencing_token=1))])
    assert isinstance(batched, LeaseResponse)
    assert batched.lease_ttl_seconds == small_rate
    assert batched.lease_expires_at == clock.now() + timedelta(seconds=small_rate)
    # the async route's batcher, as the lease route calls it
    answer = asyncio.run(lease_capacity.renew_current(
        ctx, tokens[2], LeaseRequest(fencing_token=1), clock.now()))
    assert answer is not None and answer.lease_ttl_seconds == small_rate
    # the single renewal and the full path (a new grant)
    single = nodes.renew_current(ctx, tokens[3], LeaseRequest(fencing_token=1))
    assert single is not None and single.lease_ttl_seconds == small_rate
    node_id = nodes.authenticate_node(ctx, again[0])
    full = nodes.renew_lease(ctx, node_id, None)
    assert full.new_grant and full.lease_ttl_seconds == small_rate


def test_a_dead_node_of_a_large_fleet_is_lost_after_its_own_ttl_not_before(
    ctx: ServiceContext, clock: ManualClock, small_rate: float,
) -> None:
    tokens = _register(ctx, 12)
    lease_ttl.forget(ctx.db)
    controller = NodeLeaseController(ctx, startup_grace_seconds=0)
    _register(ctx, 1)  # "n0" again, granted the fleet's TTL; its agent dies at once
    for at in (small_rate / 3, 11.0, small_rate - 0.5):  # past the configured 10 s
        clock.advance(at - _since(ctx, clock))
        lease_batch.renew_many(ctx, [lease_batch.Renewal(t, LeaseRequest(fencing_token=1))
                                     for t in tokens[1:]])  # the live agents renew
        assert controller.tick() == []
    clock.advance(1.0)
    assert controller.tick() == ["n0"]


def _since(ctx: ServiceContext, clock: ManualClock) -> float:
    """Seconds since n0's grant."""
    with ctx.db.read() as session:
        renewed = session.scalar(select(NodeModel.lease_renewed_at)
                                 .where(NodeModel.name == "n0"))
    assert renewed is not None
    return (clock.now() - renewed.replace(tzinfo=clock.now().tzinfo)).total_seconds()
