"""Duplicated, late and reordered agent status reports (issue 16's fault list), on SQLite
and PostgreSQL with a manual clock.

Invariant: a report the pod is already at or past within its attempt changes nothing and
is acknowledged (the agent retries writes whose answer it lost, and a slow request can
land after a newer one); a report of an older attempt, or one past a terminal phase, is
refused (409) and changes nothing. No report ever moves a pod backwards or applies twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from gpucloud.core.clock import ManualClock
from gpucloud.db.models import PodModel
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import agent_headers

POD = {"name": "job", "image": "busybox", "command": ["sleep", "60"], "gpus": 1}
Register = Callable[..., dict[str, Any]]


def _status(api: TestClient, reg: dict[str, Any], pod_id: str, phase: str,
            **extra: Any) -> Any:
    return api.post(f"/v1/agent/pods/{pod_id}/status", headers=agent_headers(reg),
                    json={"fencing_token": reg["fencing_token"], "phase": phase, **extra})


def _phases(api: TestClient) -> list[str]:
    return [e["to_phase"] for e in api.get("/v1/pods/job/events").json() if e["to_phase"]]


def _row(ctx: ServiceContext, pod_id: str) -> PodModel:
    with ctx.db.read() as session:
        pod = session.get_one(PodModel, pod_id)
        session.expunge(pod)
        return pod


def test_late_earlier_phases_and_duplicates_never_move_a_pod_back(
        api: TestClient, app_ctx: ServiceContext, register_node: Register,
        schedule: Callable[[], Any], clock: ManualClock) -> None:
    reg = register_node("gpu-1")
    pod = api.post("/v1/pods", json=POD).json()
    schedule()
    network = {"ip": "10.9.0.7", "ports": []}
    # Running overtook Pulling (the Pulling request was slow): Running lands first.
    assert _status(api, reg, pod["id"], "Running", attempt=1).status_code == 200
    started = _row(app_ctx, pod["id"]).started_at
    clock.advance(30)
    for late, extra in (("Pulling", {"network": network}), ("Scheduled", {"network": network}),
                        ("Running", {})):  # late, reordered, and a duplicate
        answer = _status(api, reg, pod["id"], late, attempt=1, **extra)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"phase": "Running"}
    row = _row(app_ctx, pod["id"])
    assert row.phase == "Running" and row.started_at == started  # not started twice
    assert row.network is None  # a stale report's details are not applied either
    assert _phases(api) == ["Pending", "Scheduled", "Running"]


def test_a_duplicated_failure_restarts_once_and_an_old_attempt_is_refused(
        api: TestClient, register_node: Register, schedule: Callable[[], Any],
        clock: ManualClock) -> None:
    reg = register_node("gpu-1")
    pod = api.post("/v1/pods", json={**POD, "restart": "on-failure"}).json()
    schedule()
    _status(api, reg, pod["id"], "Running", attempt=1)
    failed = {"attempt": 1, "exit_code": 3, "reason": "Error"}
    assert _status(api, reg, pod["id"], "Failed", **failed).status_code == 200
    again = _status(api, reg, pod["id"], "Failed", **failed)  # the retry of a lost answer
    assert again.status_code == 409
    got = api.get("/v1/pods/job").json()
    assert (got["phase"], got["restart_count"]) == ("Pending", 1)
    clock.advance(10)
    schedule()  # attempt 2 on the same node
    assert api.get("/v1/pods/job").json()["phase"] == "Scheduled"
    for phase in ("Running", "Failed", "Stopped"):  # attempt 1's messages, delivered late
        stale = _status(api, reg, pod["id"], phase, attempt=1, exit_code=3)
        assert stale.status_code == 409 and "attempt 1" in stale.json()["detail"]
    got = api.get("/v1/pods/job").json()
    assert (got["phase"], got["restart_count"]) == ("Scheduled", 1)
    assert _phases(api).count("Failed") == 1


def test_a_repeated_terminal_report_applies_once(
        api: TestClient, app_ctx: ServiceContext, register_node: Register,
        schedule: Callable[[], Any], clock: ManualClock) -> None:
    reg = register_node("gpu-1")
    pod = api.post("/v1/pods", json=POD).json()
    schedule()
    _status(api, reg, pod["id"], "Running", attempt=1)
    assert api.post("/v1/pods/job/stop").status_code == 200
    done = _status(api, reg, pod["id"], "Stopped", attempt=1, exit_code=143,
                   reason="Stopped", log_tail="bye\n")
    assert done.status_code == 200
    first = _row(app_ctx, pod["id"])
    events = api.get("/v1/pods/job/events").json()
    clock.advance(5)
    # The same report resent, then one with other mechanics (a SIGKILL after the grace):
    # neither rewrites the stop's reason, exit code, time or tail, nor adds an event.
    for extra in ({"exit_code": 143, "reason": "Stopped", "log_tail": "bye\n"},
                  {"exit_code": 137, "reason": "Killed", "log_tail": "other\n"}):
        answer = _status(api, reg, pod["id"], "Stopped", attempt=1, **extra)
        assert answer.status_code == 200 and answer.json() == {"phase": "Stopped"}
    row = _row(app_ctx, pod["id"])
    assert (row.phase, row.reason, row.exit_code, row.finished_at, row.log_tail) == (
        "Stopped", first.reason, 143, first.finished_at, "bye\n")
    assert api.get("/v1/pods/job/events").json() == events
    late = _status(api, reg, pod["id"], "Running", attempt=1)  # past a terminal phase
    assert late.status_code == 409
    assert _row(app_ctx, pod["id"]).phase == "Stopped"
