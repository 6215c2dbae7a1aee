"""API fixtures: the app on a manual clock (controllers driven by the test), clients."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from gpucloud.api.app import create_app
from gpucloud.controllers.loops import NodeLeaseController, SchedulingController
from gpucloud.core.clock import ManualClock
from gpucloud.core.settings import Settings
from gpucloud.db.session import Database
from gpucloud.services.context import ServiceContext
from tests.conftest import ADMIN_KEY


@pytest.fixture
def app_client(settings: Settings, clock: ManualClock) -> Iterator[TestClient]:
    """A client with no credentials on an app whose controllers the test drives."""
    app = create_app(settings, clock, run_controllers=False)
    with TestClient(app) as client:
        yield client


@pytest.fixture
def api(app_client: TestClient) -> TestClient:
    """The admin's client."""
    app_client.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
    return app_client


@pytest.fixture
def app_ctx(app_client: TestClient) -> ServiceContext:
    ctx: ServiceContext = app_client.app.state.ctx  # type: ignore[attr-defined]
    return ctx


@pytest.fixture
def schedule(app_ctx: ServiceContext) -> Callable[[], Any]:
    """Run one scheduling pass now."""
    controller = SchedulingController(app_ctx)
    return controller.tick


@pytest.fixture
def expire_leases(app_ctx: ServiceContext) -> Callable[[], list[str]]:
    return NodeLeaseController(app_ctx, startup_grace_seconds=0).tick


def h100_gpus(count: int = 8, numa_split: int = 4) -> list[dict[str, Any]]:
    return [
        {"uuid": f"GPU-{i:08d}-test", "model": "NVIDIA H100 80GB HBM3", "memory_mib": 81559,
         "numa_node": i // numa_split, "nvlink_peers": [j for j in range(count) if j != i]}
        for i in range(count)
    ]


@pytest.fixture
def register_node(api: TestClient) -> Callable[..., dict[str, Any]]:
    """Register a node through the agent protocol; returns the registration response."""

    def register(name: str, gpus: list[dict[str, Any]] | None = None, cpu: float = 64,
                 memory: int = 512 * 1024**3, **extra: Any) -> dict[str, Any]:
        token = api.post("/v1/nodes/join-tokens").json()["token"]
        response = api.post("/v1/agent/register", json={
            "join_token": token, "name": name, "cpu_cores": cpu, "memory_bytes": memory,
            "gpus": h100_gpus() if gpus is None else gpus, **extra,
        })
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body

    return register


def agent_headers(registration: dict[str, Any]) -> dict[str, str]:
    return {"Authorization": f"Bearer {registration['node_token']}"}


def renew_lease(api: TestClient, node: dict[str, Any], **body: Any) -> None:
    """One lease renewal as the node's agent sends it (``body``: health, action results)."""
    response = api.post("/v1/agent/lease", headers=agent_headers(node),
                        json={"fencing_token": node["fencing_token"], **body})
    assert response.status_code == 200, response.text


def gpu_actions(api: TestClient, node: dict[str, Any]) -> list[dict[str, Any]]:
    """The GPU actions (reset, diag, MIG mode) the node's assignments carry now."""
    response = api.get("/v1/agent/assignments", headers=agent_headers(node))
    assert response.status_code == 200, response.text
    actions: list[dict[str, Any]] = response.json()["gpu_actions"]
    return actions


class ThroughTestClient(httpx.BaseTransport):
    """Our httpx clients (the agent's, the SDK's) sending through a TestClient.

    Starlette's TestClient is built on ``httpx2`` when that is installed (the runpod SDK
    pulls it in), and its transport then returns ``httpx2`` responses that ``httpx``
    refuses; going through the TestClient's public ``request`` works with either."""

    def __init__(self, client: TestClient) -> None:
        self._client = client

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        answer = self._client.request(
            request.method, str(request.url), content=request.read(),
            headers=[(k, v) for k, v in request.headers.multi_items()
                     if k.lower() != "host"],
            follow_redirects=False)
        headers = [(k, v) for k, v in answer.headers.multi_items()
                   if k.lower() not in ("content-encoding", "content-length")]
        return httpx.Response(answer.status_code, headers=headers,
                              content=answer.content, request=request)


_TRANSACTION_CONTROL = frozenset({"BEGIN", "COMMIT", "ROLLBACK"})


@contextmanager
def statements_sent(db: Database, verbs: frozenset[str] | None = None
                    ) -> Iterator[list[str]]:
    """The SQL statements sent on ``db`` inside the block: those whose first word is one
    of ``verbs`` (e.g. ``{"SELECT"}``), or all but transaction control."""
    sent: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        verb = statement.split()[0].upper()
        if verb in verbs if verbs is not None else verb not in _TRANSACTION_CONTROL:
            sent.append(statement)

    event.listen(db.engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        event.remove(db.engine, "before_cursor_execute", record)
