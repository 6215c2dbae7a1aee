"""What the agent protocol costs the server per request (issue 16, 10,000 agents): a long
poll that ends on an unchanged revision is answered from one query; a lease renewal that
waited too long in a busy server is refused, never applied late (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import asyncssh
import pytest
from fastapi import HTTPException
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from gpucloud.api import lease_capacity
from gpucloud.api.deps import NodeCredential
from gpucloud.api.routers import agent as agent_router
from gpucloud.core.clock import ManualClock
from gpucloud.core.models import AssignmentsOut, LeaseRequest, LeaseResponse
from gpucloud.db.models import NodeModel
from gpucloud.services import assignment_answers, lease_batch
from gpucloud.services.context import ServiceContext, hash_secret
from gpucloud.services.ratelimit import api_keys
from tests.integration.conftest import agent_headers, statements_sent

SELECTS = frozenset({"SELECT"})


def _poll(api: TestClient, node: dict[str, Any], **params: Any) -> Any:
    response = api.get("/v1/agent/assignments", headers=agent_headers(node), params=params)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_poll_ending_on_an_unchanged_revision_costs_one_query(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(agent_router, "POLL_SECONDS", 60.0)  # no watcher query meanwhile
    node = register_node("cheap")
    api.post("/v1/pods", json={"name": "p1", "image": "busybox", "gpus": 1})
    schedule()
    with statements_sent(app_ctx.db, SELECTS) as built:
        full = _poll(api, node)  # no revision: the full answer, built
    assert len(built) >= 4 and [p["name"] for p in full["pods"]] == ["p1"]
    with statements_sent(app_ctx.db, SELECTS) as sent:
        again = _poll(api, node, wait=0.05, revision=full["revision"])
    assert len(sent) == 1  # the token and the revision, in one query
    assert again == full  # the answer kept for that revision, the same as built


def test_a_poll_after_a_change_gets_the_new_answer_built(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any],
) -> None:
    node = register_node("moved")
    first = _poll(api, node, wait=0.05, revision=-1)  # differs at once: built
    assert _poll(api, node, wait=0.05, revision=first["revision"]) == first  # kept
    api.post("/v1/pods", json={"name": "p2", "image": "busybox", "gpus": 1})
    schedule()
    moved = _poll(api, node, wait=5, revision=first["revision"])
    assert moved["revision"] != first["revision"]
    assert [p["name"] for p in moved["pods"]] == ["p2"]


def test_a_kept_answer_is_built_again_after_its_max_age() -> None:
    now = [0.0]
    cache = assignment_answers.AnswerCache(clock=lambda: now[0])
    answer = AssignmentsOut(revision=3, fencing_token=1, pods=[])
    cache.keep("n1", answer)
    assert cache.kept("n1", 3) is answer
    assert cache.kept("n1", 4) is None  # another revision: never the kept one
    now[0] = assignment_answers.MAX_AGE_S + 1
    assert cache.kept("n1", 3) is None


def test_edited_ssh_keys_and_registry_logins_reach_the_next_poll(
    api: TestClient, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What an answer derives from without a bind or a stop moves the revision of the
    nodes it concerns: the next poll gets it, not the answer kept for the old revision."""
    monkeypatch.setattr(agent_router, "POLL_SECONDS", 60.0)  # no watcher meanwhile
    node = register_node("derived")
    other = register_node("other", gpus=[])  # runs none of the project's pods
    login = {"name": "hub", "username": "alice", "password": "s3cret-pass"}
    assert api.post("/v1/registry-auths", json=login).status_code == 201
    api.post("/v1/pods", json={"name": "p3", "image": "busybox", "gpus": 8,
                               "registry_auth": "hub"})
    schedule()
    first = _poll(api, node)
    assert [p["registry_username"] for p in first["pods"]] == ["alice"]
    quiet = _poll(api, other)
    line = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode()
    assert api.post("/v1/ssh-keys", json={"public_key": line}).status_code == 201
    keyed = _poll(api, node, wait=0.05, revision=first["revision"])
    assert keyed["revision"] != first["revision"]
    assert line.split()[1] in keyed["pods"][0]["env"]["PUBLIC_KEY"]
    assert api.delete("/v1/registry-auths/hub").status_code == 204
    anonymous = _poll(api, node, wait=0.05, revision=keyed["revision"])
    assert anonymous["revision"] != keyed["revision"]
    assert anonymous["pods"][0]["registry_username"] is None
    assert _poll(api, other, wait=0.05, revision=quiet["revision"]) == quiet  # none of its pods


def test_a_replaced_node_token_is_refused_by_the_poll_at_once(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
) -> None:
    """No cache stands between a poll and its token: a token replaced on another replica
    (whose cache-clearing hint was lost) is refused by the very next poll."""
    node = register_node("revoked")
    _poll(api, node)  # authenticated: the node cache holds the token now
    with app_ctx.db.transaction() as session:
        session.execute(update(NodeModel).where(NodeModel.id == node["node_id"])
                        .values(token_hash=hash_secret("gpn_another")))
    response = api.get("/v1/agent/assignments", headers=agent_headers(node),
                       params={"wait": 0.05, "revision": 0})
    assert response.status_code == 401


def _expiry(ctx: ServiceContext, node_id: str) -> Any:
    with ctx.db.read() as session:
        return session.scalar(select(NodeModel.lease_expires_at).where(NodeModel.id == node_id))


def test_a_renewal_that_waited_past_half_the_ttl_is_refused_not_applied(
    api: TestClient, app_ctx: ServiceContext, clock: ManualClock,
    register_node: Callable[..., dict[str, Any]],
) -> None:
    node = register_node("late")
    ttl = app_ctx.settings.lease_ttl_seconds
    received = clock.now()
    clock.advance(ttl / 2 + 0.5)  # it waited in the server's queue meanwhile
    before = _expiry(app_ctx, node["node_id"])
    request = LeaseRequest(fencing_token=node["fencing_token"])
    with pytest.raises(HTTPException) as refused:
        asyncio.run(lease_capacity.renew_current(app_ctx, node["node_token"], request,
                                                 received))
    assert refused.value.status_code == 503
    with pytest.raises(HTTPException):  # the full path alike
        agent_router._renew_full(request, NodeCredential(
            node["node_token"], api_keys(None, node["node_token"])), received, app_ctx)
    assert _expiry(app_ctx, node["node_id"]) == before  # nothing renewed late
    fresh = asyncio.run(lease_capacity.renew_current(app_ctx, node["node_token"], request,
                                                     clock.now()))
    assert fresh is not None


def test_a_renewed_lease_counts_from_when_the_renewal_came(
    api: TestClient, app_ctx: ServiceContext, clock: ManualClock,
    register_node: Callable[..., dict[str, Any]],
) -> None:
    node = register_node("from-receipt")
    ttl = app_ctx.settings.lease_ttl_seconds
    received = clock.now()
    clock.advance(2)
    request = LeaseRequest(fencing_token=node["fencing_token"])
    (batched,) = lease_batch.renew_many(
        app_ctx, [lease_batch.Renewal(node["node_token"], request, received)])
    assert isinstance(batched, LeaseResponse)
    expected = received + timedelta(seconds=ttl)
    assert batched.lease_expires_at == expected
    assert _expiry(app_ctx, node["node_id"]).replace(tzinfo=None) == expected.replace(
        tzinfo=None)
    full = agent_router._renew_full(request, NodeCredential(
        node["node_token"], api_keys(None, node["node_token"])), received, app_ctx)
    assert full.lease_expires_at.replace(tzinfo=None) == expected.replace(tzinfo=None)
