"""How a pod report locks its node's row (services/agent.py ``_token_lock``): the
``Running`` reports of one node do not wait for one another (a share lock on the row),
while anything that changes the fencing token, and a report that writes the node (an
ended pod frees its capacity), still waits for them. PostgreSQL only: SQLite has one
writer and no row locks."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Connection, select, update

from gpucloud.core.errors import StaleFencingToken
from gpucloud.core.models import AgentPodStatusRequest
from gpucloud.core.phases import PodPhase
from gpucloud.db.models import NodeModel
from gpucloud.services import agent
from gpucloud.services.context import ServiceContext

POD = {"image": "busybox", "command": ["sleep", "60"], "gpus": 2}
WAIT_S = 5.0


@pytest.fixture
def pg(app_ctx: ServiceContext) -> ServiceContext:
    if app_ctx.db.is_sqlite:
        pytest.skip("row locks: PostgreSQL")
    return app_ctx


@contextmanager
def _report_in_flight(ctx: ServiceContext, node_id: str) -> Iterator[Connection]:
    """The node's row under the share lock a ``Running`` report holds until its commit."""
    with ctx.db.engine.connect() as holder, holder.begin():
        holder.execute(select(NodeModel.fencing_token).where(NodeModel.id == node_id)
                       .with_for_update(read=True))
        yield holder


def _in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    done: list[Any] = []

    def run() -> None:
        try:
            done.append(work())
        except Exception as error:  # noqa: BLE001 - handed to the test
            done.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


def _two_scheduled_pods(api: TestClient, register_node: Callable[..., dict[str, Any]],
                        schedule: Callable[[], Any]) -> tuple[dict[str, Any], list[str]]:
    reg = register_node("gpu-1")
    pods = [api.post("/v1/pods", json={**POD, "name": f"p{i}"}).json()["id"] for i in (1, 2)]
    schedule()
    assert {api.get(f"/v1/pods/p{i}").json()["node"] for i in (1, 2)} == {"gpu-1"}
    return reg, pods


def _report(ctx: ServiceContext, reg: dict[str, Any], pod_id: str, phase: PodPhase,
            **extra: Any) -> PodPhase:
    return agent.report_status(ctx, reg["node_id"], pod_id, AgentPodStatusRequest(
        fencing_token=reg["fencing_token"], phase=phase, **extra))


def test_running_reports_of_one_node_do_not_wait_for_each_other(
        pg: ServiceContext, api: TestClient, register_node: Callable[..., dict[str, Any]],
        schedule: Callable[[], Any]) -> None:
    reg, (first, second) = _two_scheduled_pods(api, register_node, schedule)
    with _report_in_flight(pg, reg["node_id"]):
        thread, done = _in_thread(lambda: _report(pg, reg, second, PodPhase.RUNNING))
        thread.join(WAIT_S)
        assert done == [PodPhase.RUNNING], "a Running report waited for another's commit"
    assert _report(pg, reg, first, PodPhase.RUNNING) is PodPhase.RUNNING


def _waits_for_the_report(ctx: ServiceContext, node_id: str,
                          work: Callable[[], Any]) -> Any:
    """``work`` started while a ``Running`` report of the node is in flight: it is still
    waiting half a second later, and done once the report commits. Its result."""
    with _report_in_flight(ctx, node_id):
        thread, done = _in_thread(work)
        thread.join(0.5)
        assert done == [], "it did not wait for the report's lock"
    thread.join(WAIT_S)
    assert len(done) == 1 and not isinstance(done[0], Exception), done
    return done[0]


def test_an_ended_pods_report_and_a_fencing_change_still_wait_for_it(
        pg: ServiceContext, api: TestClient, register_node: Callable[..., dict[str, Any]],
        schedule: Callable[[], Any]) -> None:
    reg, (first, second) = _two_scheduled_pods(api, register_node, schedule)
    _report(pg, reg, first, PodPhase.RUNNING)
    ended = _waits_for_the_report(
        pg, reg["node_id"], lambda: _report(pg, reg, first, PodPhase.SUCCEEDED, exit_code=0))
    assert ended is PodPhase.SUCCEEDED

    def new_grant() -> None:  # what a re-registration or a lease re-grant does to the row
        with pg.db.engine.begin() as connection:
            connection.execute(update(NodeModel).where(NodeModel.id == reg["node_id"])
                               .values(fencing_token=NodeModel.fencing_token + 1))

    _waits_for_the_report(pg, reg["node_id"], new_grant)
    with pytest.raises(StaleFencingToken):  # the report's token is the old one now
        _report(pg, reg, second, PodPhase.RUNNING)
