"""The fleet's hot path: a current lease renewal is one statement that authenticates the
node token itself; node tokens are cached, and a re-registration refuses the old one at
once; on PostgreSQL the pool pings only connections that sat idle, and recovers from a
server that dropped its connections after one failed statement."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text, update
from sqlalchemy.exc import OperationalError

from gpucloud.api import lease_capacity
from gpucloud.api.routers import agent as agent_router
from gpucloud.core.clock import ManualClock
from gpucloud.db import session as db_session
from gpucloud.db.models import NodeModel
from gpucloud.db.session import Database
from gpucloud.services import revision_watch, wakeups
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import agent_headers, statements_sent


def test_a_current_renewal_is_one_statement_and_the_rest_keep_their_answers(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
    clock: ManualClock
) -> None:
    reg = register_node("gpu-1")
    headers = agent_headers(reg)
    lease_db = lease_capacity.lease_context(app_ctx).db  # its own pool on PostgreSQL
    with statements_sent(app_ctx.db) as shared, statements_sent(lease_db) as own:
        renewed = api.post("/v1/agent/lease", headers=headers, json={"fencing_token": 1})
    assert renewed.status_code == 200 and not renewed.json()["new_grant"]
    sent = own if lease_db is not app_ctx.db else shared
    assert len(sent) == 1 and sent[0].lstrip().upper().startswith("UPDATE NODES"), sent
    assert lease_db is app_ctx.db or not shared, shared  # never the request pool
    clock.advance(5)
    node = api.get("/v1/nodes/gpu-1").json()
    assert node["lease_expires_at"] == renewed.json()["lease_expires_at"]
    wrong = {"Authorization": "Bearer gpn_not-a-token"}
    assert api.post("/v1/agent/lease", headers=wrong, json={"fencing_token": 1}).status_code == 401
    stale = api.post("/v1/agent/lease", headers=headers, json={"fencing_token": 7})
    assert stale.status_code == 409
    clock.advance(11)  # lapsed: the full path makes a new grant
    lapsed = api.post("/v1/agent/lease", headers=headers, json={"fencing_token": 1}).json()
    assert lapsed["fencing_token"] == 2 and lapsed["new_grant"]


def test_a_health_fault_still_cordons_and_clears_through_the_full_path(
    api: TestClient, register_node: Callable[..., dict[str, Any]]
) -> None:
    reg = register_node("gpu-1")
    headers = agent_headers(reg)
    api.post("/v1/agent/lease", headers=headers, json={"fencing_token": 1, "node_fault": "XID 79"})
    assert api.get("/v1/nodes/gpu-1").json()["cordon_reason"] == "XID 79"
    api.post("/v1/agent/lease", headers=headers, json={"fencing_token": 1})  # fault gone
    node = api.get("/v1/nodes/gpu-1").json()
    assert not node["cordoned"] and node["cordon_reason"] is None


def test_node_tokens_are_cached_and_a_re_registration_refuses_the_old_one_at_once(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]]
) -> None:
    first = register_node("gpu-1")
    assert api.get("/v1/agent/assignments", headers=agent_headers(first)).status_code == 200
    with statements_sent(app_ctx.db) as sent:  # the token is checked by the poll's one read of
        assert api.get("/v1/agent/assignments",  # its revision, no query of its own
                       headers=agent_headers(first)).status_code == 200
    by_token = [s for s in sent if "WHERE nodes.token_hash" in s]
    assert len(by_token) == 1 and "assignments_revision" in by_token[0], sent
    second = register_node("gpu-1")
    assert api.get("/v1/agent/assignments", headers=agent_headers(first)).status_code == 401
    assert api.get("/v1/agent/assignments", headers=agent_headers(second)).status_code == 200


def _backend(db: Database) -> int:
    with db.read() as session:
        return int(session.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _kill(killer: Database, pid: int) -> None:
    """Terminate one server session (what a PostgreSQL restart does to all of them)."""
    with killer.engine.connect() as connection:
        assert connection.execute(text("SELECT pg_terminate_backend(:pid)"),
                                  {"pid": pid}).scalar()


def test_the_pool_pings_idle_connections_and_recovers_from_dropped_ones(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    db, killer = Database(postgres_url), Database(postgres_url)
    try:
        with statements_sent(db) as sent:
            pids = {_backend(db) for _ in range(3)}
        assert len(sent) == 3 and len(pids) == 1  # a busy pool: no ping per checkout
        _kill(killer, pids.pop())
        with pytest.raises(OperationalError), db.read() as session:
            session.execute(text("SELECT 1"))  # a busy connection finds out: one failure
        pid = _backend(db)  # the pool was renewed after that one failure
        monkeypatch.setattr(db_session, "PING_AFTER_IDLE_SECONDS", 0.0)
        _kill(killer, pid)
        assert _backend(db) != pid  # an idle connection is pinged and replaced
    finally:
        db.dispose()
        killer.dispose()


def test_a_change_from_another_replica_wakes_the_poll_through_the_batched_watch(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_router, "POLL_SECONDS", 0.05)
    nodes = [register_node(f"gpu-{i}") for i in range(3)]
    node = nodes[0]
    revision = api.get("/v1/agent/assignments", headers=agent_headers(node)).json()["revision"]
    answers: list[dict[str, Any]] = []

    def poll() -> None:
        answers.append(api.get("/v1/agent/assignments", headers=agent_headers(node),
                               params={"wait": 30, "revision": revision}).json())

    poller = threading.Thread(target=poll)
    started = time.monotonic()
    poller.start()
    while wakeups.ASSIGNMENTS.listeners(node["node_id"]) == 0 and poller.is_alive():
        threading.Event().wait(0.01)
    with app_ctx.db.transaction() as session:  # as another replica would: no wake-up here
        session.execute(update(NodeModel).where(NodeModel.id == node["node_id"])
                        .values(assignments_revision=NodeModel.assignments_revision + 1))
    poller.join(timeout=30)
    assert answers and answers[0]["revision"] == revision + 1
    assert time.monotonic() - started < 10
    watch = revision_watch.watcher(app_ctx, lambda: 60.0)
    with statements_sent(app_ctx.db) as sent:
        watch.check([n["node_id"] for n in nodes])
    assert len(sent) == 1  # one query for every waiting node


def test_the_pool_keeps_the_connections_a_burst_opened(postgres_url: str) -> None:
    """A burst of concurrent requests above the old kept size (16) and back: the next
    burst reuses the same PostgreSQL sessions. An overflow connection was closed as it
    was returned, so a replica hovering above the kept size forked backends all the time."""
    db = Database(postgres_url)
    try:
        def burst() -> set[int]:
            held = [db.engine.connect() for _ in range(db_session.POOL_SIZE)]
            try:
                return {int(c.execute(text("SELECT pg_backend_pid()")).scalar_one())
                        for c in held}
            finally:
                for connection in held:
                    connection.close()

        first = burst()
        assert len(first) == db_session.POOL_SIZE > 16
        assert burst() == first
    finally:
        db.dispose()


def test_a_waiting_poll_is_not_woken_by_the_watchers_first_look(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]]
) -> None:
    """The poll tells the watcher the revision it read: the watcher's first look at the
    node finds nothing moved (no wake-up, no answer built for nothing), and a change
    after the poll's read still wakes it."""
    node = register_node("gpu-1")
    revision = api.get("/v1/agent/assignments", headers=agent_headers(node)).json()["revision"]
    answers: list[dict[str, Any]] = []
    poller = threading.Thread(target=lambda: answers.append(api.get(
        "/v1/agent/assignments", headers=agent_headers(node),
        params={"wait": 30, "revision": revision}).json()))
    poller.start()
    while wakeups.ASSIGNMENTS.listeners(node["node_id"]) == 0 and poller.is_alive():
        threading.Event().wait(0.01)
    watch = revision_watch.watcher(app_ctx, lambda: 60.0)
    assert watch.check([node["node_id"]]) == []  # before: new to it, so woken
    with app_ctx.db.transaction() as session:  # as another replica would: no wake-up here
        session.execute(update(NodeModel).where(NodeModel.id == node["node_id"])
                        .values(assignments_revision=NodeModel.assignments_revision + 1))
    moved = watch.check([node["node_id"]])
    poller.join(timeout=30)
    assert answers and answers[0]["revision"] == revision + 1
    assert moved in ([node["node_id"]], [])  # [] only if the watcher's thread looked first
    fresh = revision_watch.RevisionWatcher(app_ctx, lambda: 60.0)  # one no poll told
    assert fresh.check([node["node_id"]]) == [node["node_id"]]
