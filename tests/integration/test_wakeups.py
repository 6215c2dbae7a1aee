"""Long-poll wake-ups: a committed change wakes the agent's poll at once; a rolled-back one
never does (real SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from gpucloud.api.routers import agent as agent_router
from gpucloud.db.models import NodeModel
from gpucloud.db.session import on_commit
from gpucloud.services import wakeups
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import agent_headers


def test_on_commit_runs_after_commit_and_never_after_rollback(app_ctx: ServiceContext) -> None:
    calls: list[str] = []
    with app_ctx.db.transaction() as session:
        on_commit(session, lambda: calls.append("committed"))
        session.scalar(select(NodeModel.id))
        assert calls == []
    assert calls == ["committed"]
    with pytest.raises(RuntimeError), app_ctx.db.transaction() as session:
        on_commit(session, lambda: calls.append("rolled back"))
        raise RuntimeError
    with app_ctx.db.transaction() as session:
        session.scalar(select(NodeModel.id))
    assert calls == ["committed"]


def test_a_listener_is_woken_from_another_thread_and_forgotten_after() -> None:
    signals = wakeups.Wakeups()

    async def scenario() -> tuple[bool, bool]:
        with signals.listen("n1") as woken:
            threading.Thread(target=signals.notify, args=("n1",)).start()
            first = await wakeups.wait(woken, 30)
        with signals.listen("n1") as woken:
            signals.notify("n2")
            second = await wakeups.wait(woken, 0)
        return first, second

    assert asyncio.run(scenario()) == (True, False)
    assert signals.listeners("n1") == 0
    signals.notify("n1")  # nobody listens: nothing to do


def test_a_binding_wakes_the_long_poll_without_waiting_for_the_period(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_router, "POLL_SECONDS", 60.0)  # only a wake-up can end it soon
    node = register_node("a")
    revision = api.get("/v1/agent/assignments", headers=agent_headers(node)).json()["revision"]
    answers: list[dict[str, Any]] = []

    def poll() -> None:
        answers.append(api.get("/v1/agent/assignments", headers=agent_headers(node),
                               params={"wait": 60, "revision": revision}).json())

    poller = threading.Thread(target=poll)
    poller.start()
    while wakeups.ASSIGNMENTS.listeners(node["node_id"]) == 0 and poller.is_alive():
        threading.Event().wait(0.01)
    api.post("/v1/pods", json={"name": "woken", "image": "busybox", "gpus": 1})
    schedule()
    poller.join(timeout=30)
    assert not poller.is_alive()
    assert [p["name"] for p in answers[0]["pods"]] == ["woken"]
    assert answers[0]["revision"] != revision
