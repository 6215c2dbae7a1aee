"""The agent's retry loops (agent/connection.py) honour a real server's 503 + Retry-After:
the next attempt comes no sooner than the server asked (bounded, jittered upwards), not
on the agent's own 0.1–0.2 s first back-off. The waits are recorded, not slept."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from gpucloud.agent.backoff import RETRY_AFTER_JITTER
from gpucloud.agent.connection import Connection
from gpucloud.agent.identity import IdentityFile
from gpucloud.api import errors, register_capacity
from gpucloud.core.models import AgentPodStatusRequest, NodeRegisterRequest
from gpucloud.core.phases import PodPhase
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import ThroughTestClient, h100_gpus


class Waits:
    """The agent's sleeps: each delay recorded; ``then`` runs once, at the first one (what
    the server's state becomes while the agent waits)."""

    def __init__(self, then: Callable[[], None] = lambda: None) -> None:
        self.delays: list[float] = []
        self.then = then

    def __call__(self, stop: threading.Event, seconds: float) -> bool:
        self.delays.append(seconds)
        if len(self.delays) == 1:
            self.then()
        return stop.is_set()


def _registration(token: str, name: str) -> NodeRegisterRequest:
    return NodeRegisterRequest(join_token=token, name=name, cpu_cores=64,
                               memory_bytes=512 * 1024**3, gpus=h100_gpus())


def _connection(api: TestClient, tmp_path: Path, token: str, name: str,
                waits: Waits) -> Connection:
    return Connection("http://testserver", _registration(token, name),
                      IdentityFile(tmp_path / name), threading.Event(),
                      transport=ThroughTestClient(api), sleep=waits)


@contextmanager
def _registrations_busy(api: TestClient, ctx: ServiceContext,
                        token: str) -> Iterator[Callable[[], None]]:
    """The server's registration capacity full (1 thread, 1 waiting place: one held at
    its first statement, one queued): the next registration is refused at once, 503 +
    Retry-After. Yields ``free()``, which lets both finish."""
    reached, release = threading.Event(), threading.Event()

    def hold(*_args: Any) -> None:
        if not reached.is_set():
            reached.set()
            release.wait(timeout=30)

    event.listen(ctx.db.engine, "before_cursor_execute", hold)
    answers: list[int] = []
    threads = [threading.Thread(target=lambda n=n: answers.append(api.post(
        "/v1/agent/register", json=_registration(token, f"busy-{n}").model_dump(
            mode="json")).status_code), daemon=True) for n in range(2)]
    threads[0].start()
    assert reached.wait(timeout=20), "the registration never reached the database"
    threads[1].start()
    portal = api.portal
    assert portal is not None
    state = portal.call(register_capacity.admission)
    while state.admitted < 2:
        threading.Event().wait(0.01)

    def free() -> None:
        release.set()
        for thread in threads:
            thread.join(timeout=20)

    try:
        yield free
    finally:
        free()
        event.remove(ctx.db.engine, "before_cursor_execute", hold)
    assert answers == [201, 201]


@pytest.fixture
def small_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(register_capacity, "REGISTER_THREADS", 1)
    monkeypatch.setattr(register_capacity, "REGISTER_QUEUE", 1)


@pytest.mark.usefixtures("small_capacity")
def test_a_refused_registration_waits_its_retry_after(
        api: TestClient, app_ctx: ServiceContext, tmp_path: Path) -> None:
    token = api.post("/v1/nodes/join-tokens", json={"uses": 5}).json()["token"]
    with _registrations_busy(api, app_ctx, token) as free:
        waits = Waits(then=free)
        connection = _connection(api, tmp_path, token, "late", waits)
        connection.connect()  # refused (503, Retry-After: 2), waits, registers
    asked = register_capacity.RETRY_AFTER_S
    assert len(waits.delays) == 1
    assert asked <= waits.delays[0] <= asked * (1 + RETRY_AFTER_JITTER), waits.delays
    assert connection.node_id is not None
    connection.close()


def test_a_write_refused_while_the_database_is_unavailable_waits_its_retry_after(
        api: TestClient, app_ctx: ServiceContext, tmp_path: Path) -> None:
    """A pod status report answered 503 + Retry-After (the database unreachable,
    api/errors.py) twice is sent a third time, each retry after at least what was asked."""
    token = api.post("/v1/nodes/join-tokens").json()["token"]
    connection = _connection(api, tmp_path, token, "gpu-1", Waits())
    connection.connect()
    failures = [2]

    def unreachable(*_args: Any) -> None:
        if failures[0] > 0:
            failures[0] -= 1
            raise OperationalError("SELECT 1", {}, ConnectionError("server closed"))

    waits = Waits()
    connection._sleep = waits  # noqa: SLF001 - the retry loop's waits, recorded
    report = AgentPodStatusRequest(fencing_token=connection.fencing_token,
                                   phase=PodPhase.RUNNING)
    event.listen(app_ctx.db.engine, "before_cursor_execute", unreachable)
    try:
        # no such pod: once the database answers, the report is refused (404), dropped
        assert connection.write("a report", lambda client, fencing: client.report_status(
            "missing-pod", report.model_copy(update={"fencing_token": fencing}))) is None
    finally:
        event.remove(app_ctx.db.engine, "before_cursor_execute", unreachable)
    asked = errors.DATABASE_RETRY_AFTER_SECONDS
    assert failures == [0] and len(waits.delays) == 2, waits.delays
    assert all(asked <= d <= asked * (1 + RETRY_AFTER_JITTER) for d in waits.delays)
    connection.close()
