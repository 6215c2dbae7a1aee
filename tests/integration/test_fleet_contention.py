"""What serialized a fleet's agents (bench/fleet.py): a registration held the join token's
row lock, and a pooled connection while it waited, to the end of its transaction; the
lease renewals shared that request pool. Now a re-registration does not touch the token's
row, a new node's use is its transaction's last statement, and renewals have a pool of
their own (PostgreSQL)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Connection, event, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import QueuePool

from gpucloud.agent.connection import Connection as AgentConnection
from gpucloud.agent.identity import IdentityFile
from gpucloud.client.sdk import AgentClient, ApiError
from gpucloud.core.models import NodeRegisterRequest
from gpucloud.services import nodes
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import agent_headers, h100_gpus


def _register(api: TestClient, token: str, name: str) -> Any:
    return api.post("/v1/agent/register", json={
        "join_token": token, "name": name, "cpu_cores": 8, "memory_bytes": 1 << 34,
        "gpus": h100_gpus(1)})


def _uses(api: TestClient, token_id: str) -> int:
    listed = {t["id"]: t for t in api.get("/v1/nodes/join-tokens").json()}
    return int(listed[token_id]["uses"])


def test_uses_count_new_nodes_and_a_used_up_token_re_registers_nothing(
        api: TestClient) -> None:
    two = api.post("/v1/nodes/join-tokens", json={"uses": 2}).json()
    assert _register(api, two["token"], "a").status_code == 201
    assert _register(api, two["token"], "a").status_code == 201  # a restart: no use spent
    assert _uses(api, two["id"]) == 1
    assert _register(api, two["token"], "b").status_code == 201
    assert _uses(api, two["id"]) == 2
    assert _register(api, two["token"], "c").status_code == 401
    # used up, it is refused for a known node too (else a spent single-use token
    # could take over any node by its name)
    assert _register(api, two["token"], "a").status_code == 401
    revoked = api.post("/v1/nodes/join-tokens").json()
    assert _register(api, revoked["token"], "r").status_code == 201
    api.post(f"/v1/nodes/join-tokens/{revoked['id']}/revoke")
    assert _register(api, revoked["token"], "r").status_code == 401


@contextmanager
def _row_locked(ctx: ServiceContext, table: str, row_id: str,
                seconds: float = 8.0) -> Iterator[None]:
    """Another transaction holding a row's lock for ``seconds`` at most (or until the
    block ends): a call that waits for it returns late, not never."""
    release, locked = threading.Event(), threading.Event()

    def hold() -> None:
        with ctx.db.engine.connect() as connection, connection.begin():
            connection.execute(text(f"SELECT 1 FROM {table} WHERE id = :id FOR UPDATE"),
                               {"id": row_id})
            locked.set()
            release.wait(seconds)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(10)
        yield
    finally:
        release.set()
        holder.join()


def _timed(call: Any) -> tuple[float, Any]:
    started = time.monotonic()
    out = call()
    return time.monotonic() - started, out


@pytest.fixture
def postgres_only(database_url: str) -> None:
    if database_url.startswith("sqlite"):
        pytest.skip("row locks and the lease pool: PostgreSQL")


@pytest.mark.usefixtures("postgres_only")
def test_a_re_registration_does_not_wait_for_the_join_tokens_row(
        api: TestClient, app_ctx: ServiceContext) -> None:
    token = api.post("/v1/nodes/join-tokens").json()
    assert _register(api, token["token"], "n1").status_code == 201
    with _row_locked(app_ctx, "join_tokens", token["id"]):
        seconds, again = _timed(lambda: _register(api, token["token"], "n1"))
    assert again.status_code == 201 and seconds < 3, seconds


@pytest.mark.usefixtures("postgres_only")
def test_a_new_nodes_use_is_a_statement_of_its_own(
        api: TestClient, app_ctx: ServiceContext) -> None:
    """The token's row is locked only while that one statement runs (autocommit), never
    for the rest of a registration's transaction."""
    token = api.post("/v1/nodes/join-tokens").json()["token"]
    spends: list[object] = []

    def record(conn: Connection, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.lstrip().upper().startswith("UPDATE JOIN_TOKENS"):
            spends.append(conn.get_execution_options().get("isolation_level"))

    event.listen(app_ctx.db.engine, "before_cursor_execute", record)
    try:
        assert _register(api, token, "n1").status_code == 201
        assert _register(api, token, "n1").status_code == 201  # known: no spend at all
    finally:
        event.remove(app_ctx.db.engine, "before_cursor_execute", record)
    assert spends == ["AUTOCOMMIT"], spends


def test_a_failed_registration_gives_its_use_back(
        api: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    one = api.post("/v1/nodes/join-tokens", json={"uses": 1}).json()

    def fails(*_args: Any) -> None:
        raise OperationalError("INSERT", {}, Exception("the database went away"))

    monkeypatch.setattr(nodes, "_register", fails)  # the node's transaction fails
    assert _register(api, one["token"], "n1").status_code == 503
    assert _uses(api, one["id"]) == 0
    monkeypatch.undo()
    assert _register(api, one["token"], "n1").status_code == 201  # still usable once


@pytest.mark.usefixtures("postgres_only")
def test_renewals_do_not_wait_for_an_exhausted_request_pool(
        api: TestClient, app_ctx: ServiceContext) -> None:
    """Every request-pool connection taken (a storm of requests each holding one): the
    current renewal and the full path (a new grant) still answer at once."""
    token = api.post("/v1/nodes/join-tokens").json()["token"]
    reg = _register(api, token, "n1").json()
    pool = app_ctx.db.engine.pool
    assert isinstance(pool, QueuePool)
    held: list[Connection] = []
    try:
        while pool.checkedout() < pool.size() + pool._max_overflow:  # noqa: SLF001
            held.append(app_ctx.db.engine.connect())
        headers = agent_headers(reg)
        seconds, current = _timed(lambda: api.post("/v1/agent/lease", headers=headers,
                                                   json={"fencing_token": 1}))
        assert current.status_code == 200 and seconds < 3, seconds
        seconds, fresh = _timed(lambda: api.post("/v1/agent/lease", headers=headers,
                                                 json={"fencing_token": None}))
        assert fresh.status_code == 200 and fresh.json()["new_grant"] and seconds < 3
    finally:
        for connection in held:
            connection.close()


@pytest.mark.usefixtures("postgres_only")
def test_a_lease_statement_stuck_on_a_row_lock_answers_503_in_bounded_time(
        api: TestClient, app_ctx: ServiceContext) -> None:
    """The lease pool's statement timeout: a renewal queued behind a lock held for long
    (a stuck transaction on the node's row) fails fast, inside the agent's timeout,
    instead of holding a lease thread until the lease is gone."""
    token = api.post("/v1/nodes/join-tokens").json()["token"]
    reg = _register(api, token, "n1").json()
    with _row_locked(app_ctx, "nodes", reg["node_id"], seconds=30):
        seconds, answer = _timed(lambda: api.post(  # the full path: SELECT … FOR UPDATE
            "/v1/agent/lease", headers=agent_headers(reg), json={"fencing_token": None}))
        assert answer.status_code == 503 and seconds < 6, (answer.status_code, seconds)


def test_the_agents_renewal_gives_up_inside_its_lease(tmp_path: Path) -> None:
    """A replica that accepts the connection and never answers (hung, or dead behind the
    balancer): the renewal fails at half the TTL, in time to be sent again while the
    lease holds, not at the client's 30 s default, when the node is Lost already."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never reads
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        registration = NodeRegisterRequest(join_token="gpj_x", name="n1", cpu_cores=1,
                                           memory_bytes=1 << 30, gpus=[])
        connection = AgentConnection(url, registration, IdentityFile(tmp_path), threading.Event())
        connection._adopt(AgentClient(url, "gpn_x"), 1, 2.0)  # noqa: SLF001 - a TTL of 2 s
        assert connection.lease_timeout == 1.0
        seconds, _ = _timed(lambda: pytest.raises(ApiError, connection.renew))
        connection.close()
    assert 0.9 <= seconds < 1.9, seconds
