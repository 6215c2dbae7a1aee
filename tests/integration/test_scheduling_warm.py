"""A warm start's server side (issue 11): one pending pod on an idle cloud is placed by a
pass of few statements in two fenced write transactions, and its agent's waiting poll is
answered from what the controller built right after the bind (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpucloud.controllers.loops import ControllerRunner
from gpucloud.services import assignment_answers, wakeups
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import statements_sent

#: The leader's fence: one per write transaction of a controller.
FENCE = "FROM controller_leases"


def _pod(name: str) -> dict[str, Any]:
    return {"name": name, "image": "busybox", "command": ["true"], "gpus": 1}


@pytest.fixture
def runner(app_ctx: ServiceContext) -> Iterator[ControllerRunner]:
    """The controllers as the server runs them (fenced by the leader lease), not started:
    the test drives their ticks."""
    controllers = ControllerRunner(app_ctx)
    assert controllers._is_leader()
    yield controllers
    controllers.leader.stop()


def test_a_warm_pass_places_one_pod_in_two_fenced_transactions_of_few_statements(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
    runner: ControllerRunner,
) -> None:
    register_node("a")
    api.post("/v1/pods", json=_pod("first"))
    runner.run_once(woken=True)  # the snapshot cache is warm, the node's row bumped
    assert api.get("/v1/pods/first").json()["phase"] == "Scheduled"
    api.post("/v1/pods", json=_pod("second"))
    with statements_sent(app_ctx.db) as jobs:
        runner.jobs.tick()
    assert len(jobs) == 1  # no job anywhere: one read says so
    with statements_sent(app_ctx.db) as sent:
        result = runner.scheduling.tick()
    assert len(result.scheduled) == 1
    assert api.get("/v1/pods/second").json()["phase"] == "Scheduled"
    assert len([s for s in sent if FENCE in s]) == 2  # the lease and the bind
    # lease 1, cluster read 5 (node keys, holdings, load samples, quotas, head gang),
    # bind 3 (node, pod, event), fences 2
    assert len(sent) <= 11, sent
    # the node's row is not loaded again for the bump of the first pass's own bind
    assert len([s for s in sent if "FROM nodes" in s and "UPDATE" not in s]) == 1


def test_an_idle_pass_takes_one_write_statement_and_binds_nothing(
    app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
    runner: ControllerRunner,
) -> None:
    register_node("a")
    runner.scheduling.tick()  # takes the registration's capacity mark (services/capacity.py)
    with statements_sent(app_ctx.db) as sent:
        result = runner.scheduling.tick()
    assert result.considered == 0 and len(sent) == 2  # the fence and the empty lease


def test_a_primed_answer_is_served_once_with_no_query(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any],
) -> None:
    node = register_node("a")
    api.post("/v1/pods", json=_pod("p"))
    schedule()
    now = [0.0]
    cache = assignment_answers.AnswerCache(clock=lambda: now[0])
    cache.prime(app_ctx, node["node_id"])
    with statements_sent(app_ctx.db) as sent:
        primed = cache.answer(app_ctx, node["node_id"], None)
    assert not sent and [p.name for p in primed.pods] == ["p"]
    with statements_sent(app_ctx.db) as sent:
        again = cache.answer(app_ctx, node["node_id"], None)
    assert sent and again == primed  # served once: the next poll that asks builds it
    cache.prime(app_ctx, node["node_id"])
    now[0] = assignment_answers.PRIMED_MAX_AGE_S + 1
    with statements_sent(app_ctx.db) as sent:
        cache.answer(app_ctx, node["node_id"], None)
    assert sent  # too old for the poll it was built for: built again


def test_the_pass_builds_the_answer_of_a_waiting_poll_before_waking_it(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
    runner: ControllerRunner,
) -> None:
    node_id = register_node("a")["node_id"]
    pod = api.post("/v1/pods", json=_pod("p")).json()

    async def poll() -> bool:
        with wakeups.ASSIGNMENTS.listen(node_id) as woken:
            await asyncio.to_thread(runner.scheduling.tick)
            return await wakeups.wait(woken, 5.0)

    assert asyncio.run(poll())
    with statements_sent(app_ctx.db) as sent:
        answer = assignment_answers.ANSWERS.answer(app_ctx, node_id, None)
    assert not sent and [p.pod_id for p in answer.pods] == [pod["id"]]
