"""The node agent protocol: registration, leases and fencing, assignments, status, logs,
lost nodes and restarts — driven with a manual clock."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from gpucloud.controllers.loops import NodeLeaseController
from gpucloud.core.clock import ManualClock
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import agent_headers

POD = {"name": "job", "image": "busybox", "command": ["sleep", "60"], "gpus": 2}


def _status(api: TestClient, reg: dict[str, Any], pod_id: str, phase: str,
            token: int | None = None, **extra: Any) -> Any:
    return api.post(f"/v1/agent/pods/{pod_id}/status", headers=agent_headers(reg),
                    json={"fencing_token": token or reg["fencing_token"], "phase": phase,
                          **extra})


def _assignments(api: TestClient, reg: dict[str, Any], **params: Any) -> dict[str, Any]:
    response = api.get("/v1/agent/assignments", headers=agent_headers(reg), params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_register_requires_a_valid_join_token(api: TestClient, clock: ManualClock) -> None:
    body = {"join_token": "gpj_nope", "name": "n1", "cpu_cores": 8, "memory_bytes": 1 << 34}
    assert api.post("/v1/agent/register", json=body).status_code == 401
    token = api.post("/v1/nodes/join-tokens").json()["token"]
    clock.advance(25 * 3600)
    assert api.post("/v1/agent/register", json={**body, "join_token": token}).status_code == 401
    bad = api.post("/v1/agent/register", json={**body, "join_token": token, "cpu_cores": -1})
    assert bad.status_code == 422 and bad.json()["field"] == "cpu_cores"


def test_registration_records_inventory_and_labels(
    api: TestClient, register_node: Callable[..., dict[str, Any]]
) -> None:
    reg = register_node("gpu-1", labels={"zone": "z1", "rack": "r7", "block": "b2"},
                        address="127.0.0.2")
    assert reg["fencing_token"] == 1
    node = api.get("/v1/nodes/gpu-1").json()
    assert node["status"] == "Ready" and len(node["gpus"]) == 8
    assert node["gpus"][3]["model"] == "H100-80GB" and node["gpus"][5]["numa_node"] == 1
    assert node["gpus"][0]["nvlink_peers"] == [1, 2, 3, 4, 5, 6, 7]
    assert node["labels"] == {"zone": "z1", "rack": "r7", "block": "b2"}
    assert node["address"] == "127.0.0.2"


def test_lease_renewal_keeps_token_and_new_grant_increments_it(
    api: TestClient, register_node: Callable[..., dict[str, Any]], clock: ManualClock
) -> None:
    reg = register_node("gpu-1")
    headers = agent_headers(reg)
    renewed = api.post("/v1/agent/lease", headers=headers, json={"fencing_token": 1}).json()
    assert renewed["fencing_token"] == 1 and not renewed["new_grant"]
    grant = api.post("/v1/agent/lease", headers=headers, json={"fencing_token": None}).json()
    assert grant["fencing_token"] == 2 and grant["new_grant"]
    stale = api.post("/v1/agent/lease", headers=headers, json={"fencing_token": 1})
    assert stale.status_code == 409
    clock.advance(11)
    lapsed = api.post("/v1/agent/lease", headers=headers, json={"fencing_token": 2}).json()
    assert lapsed["fencing_token"] == 3 and lapsed["new_grant"]
    assert api.post("/v1/agent/lease", json={"fencing_token": 3}).status_code == 401


def test_stale_fencing_token_write_is_409_and_changes_nothing(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    reg = register_node("gpu-1")
    pod = api.post("/v1/pods", json=POD).json()
    schedule()
    api.post("/v1/agent/lease", headers=agent_headers(reg), json={"fencing_token": None})
    response = _status(api, reg, pod["id"], "Running", token=1)
    assert response.status_code == 409 and "fencing token" in response.json()["detail"]
    assert api.get("/v1/pods/job").json()["phase"] == "Scheduled"
    chunk = api.post(f"/v1/agent/pods/{pod['id']}/logs", headers=agent_headers(reg),
                     json={"fencing_token": 1, "offset": 0, "data": "hi\n"})
    assert chunk.status_code == 409
    assert api.get("/v1/pods/job/logs").json()["text"] == ""


def test_assignments_long_poll_returns_on_change(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    reg = register_node("gpu-1")
    first = _assignments(api, reg)
    assert first["pods"] == []
    same = _assignments(api, reg, revision=first["revision"], wait=0.3)
    assert same["revision"] == first["revision"]
    pod = api.post("/v1/pods", json=POD).json()
    schedule()
    changed = _assignments(api, reg, revision=first["revision"], wait=30)
    assert changed["revision"] > first["revision"]
    [assigned] = changed["pods"]
    assert assigned["pod_id"] == pod["id"] and len(assigned["gpu_uuids"]) == 2
    assert assigned["desired_state"] == "running" and assigned["attempt"] == 1


def test_status_lifecycle_logs_and_events(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    reg = register_node("gpu-1")
    pod = api.post("/v1/pods", json=POD).json()
    schedule()
    assert _status(api, reg, pod["id"], "Pulling").status_code == 200
    assert _status(api, reg, pod["id"], "Running").status_code == 200
    for offset, data in [(0, "hello\n"), (6, "wörld\n")]:
        response = api.post(f"/v1/agent/pods/{pod['id']}/logs", headers=agent_headers(reg),
                            json={"fencing_token": 1, "offset": offset, "data": data})
        assert response.status_code == 200
    replay = api.post(f"/v1/agent/pods/{pod['id']}/logs", headers=agent_headers(reg),
                      json={"fencing_token": 1, "offset": 0, "data": "hello\n"})
    assert replay.json()["next_offset"] == 13
    assert api.get("/v1/pods/job/logs").json()["text"] == "hello\nwörld\n"
    assert api.get("/v1/pods/job/logs", params={"offset": 6}).json()["text"] == "wörld\n"
    done = _status(api, reg, pod["id"], "Succeeded", exit_code=0)
    assert done.status_code == 200
    got = api.get("/v1/pods/job").json()
    assert got["phase"] == "Succeeded" and got["exit_code"] == 0 and got["node"] == "gpu-1"
    phases = [e["to_phase"] for e in api.get("/v1/pods/job/events").json()]
    assert phases == ["Pending", "Scheduled", "Pulling", "Running", "Succeeded"]
    late = _status(api, reg, pod["id"], "Running")
    assert late.status_code == 409


def test_failed_pod_with_on_failure_restarts_after_backoff(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any],
    clock: ManualClock,
) -> None:
    reg = register_node("gpu-1")
    pod = api.post("/v1/pods", json={**POD, "restart": "on-failure"}).json()
    schedule()
    _status(api, reg, pod["id"], "Running")
    _status(api, reg, pod["id"], "Failed", exit_code=3, reason="Error", message="exit 3")
    got = api.get("/v1/pods/job").json()
    assert got["phase"] == "Pending" and got["restart_count"] == 1
    assert "back-off" in api.get("/v1/pods/job/why").json()["summary"]
    schedule()
    assert api.get("/v1/pods/job").json()["phase"] == "Pending"
    clock.advance(6)
    schedule()
    assert api.get("/v1/pods/job").json()["phase"] == "Scheduled"
    assert _assignments(api, reg)["pods"][0]["attempt"] == 2


def test_user_stop_goes_through_the_agent(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    reg = register_node("gpu-1")
    pod = api.post("/v1/pods", json={**POD, "restart": "always"}).json()
    schedule()
    _status(api, reg, pod["id"], "Running")
    before = _assignments(api, reg)["revision"]
    assert api.post("/v1/pods/job/stop").json()["desired_state"] == "stopped"
    after = _assignments(api, reg)
    assert after["revision"] > before and after["pods"][0]["desired_state"] == "stopped"
    _status(api, reg, pod["id"], "Stopped", exit_code=143)
    assert api.get("/v1/pods/job").json()["phase"] == "Stopped"


def test_lost_node_loses_its_pods_and_restart_always_reschedules(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any],
    expire_leases: Callable[[], list[str]], clock: ManualClock,
) -> None:
    reg1 = register_node("gpu-1")
    keep = api.post("/v1/pods", json={**POD, "name": "keep", "restart": "always"}).json()
    once = api.post("/v1/pods", json={**POD, "name": "once", "gpus": 6}).json()
    schedule()
    assert api.get("/v1/pods/keep").json()["node"] == "gpu-1"
    _status(api, reg1, keep["id"], "Running")
    clock.advance(5)
    reg2 = register_node("gpu-2")
    clock.advance(6)
    api.post("/v1/agent/lease", headers=agent_headers(reg2), json={"fencing_token": 1})
    assert expire_leases() == ["gpu-1"]
    assert api.get("/v1/nodes/gpu-1").json()["status"] == "Lost"
    assert api.get(f"/v1/pods/{once['id']}").json()["phase"] == "Lost"
    assert api.get("/v1/pods/keep").json()["phase"] == "Pending"
    schedule()
    moved = api.get("/v1/pods/keep").json()
    assert moved["phase"] == "Scheduled" and moved["node"] == "gpu-2"
    reasons = [e["reason"] for e in api.get("/v1/pods/keep/events").json()]
    assert reasons[-3:] == ["NodeLost", "Rescheduling", "Scheduled"]
    late = _status(api, reg1, keep["id"], "Running")
    assert late.status_code == 409
    assert expire_leases() == []


def _ship(api: TestClient, reg: dict[str, Any], pod: dict[str, Any], attempt: int,
          offset: int, data: str) -> None:
    response = api.post(f"/v1/agent/pods/{pod['id']}/logs", headers=agent_headers(reg),
                        json={"fencing_token": reg["fencing_token"], "attempt": attempt,
                              "offset": offset, "data": data})
    assert response.status_code == 200, response.text


def test_logs_count_bytes_and_a_follower_keeps_the_start_of_a_new_attempt(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    reg = register_node("gpu-1")
    pod = api.post("/v1/pods", json=POD).json()
    schedule()
    _status(api, reg, pod["id"], "Running", attempt=1)
    _ship(api, reg, pod, 1, 0, "wörld\n")
    seen = api.get("/v1/pods/job/logs").json()
    assert (seen["next_offset"], seen["attempt"]) == (7, 1)  # bytes, not characters
    assert api.get("/v1/pods/job/logs", params={"tail": 3}).json()["text"] == "ld\n"
    assert api.get("/v1/pods/job/logs", params={"tail": 5}).json()["text"] == "rld\n"
    _ship(api, reg, pod, 1, 7, "bye\n")
    api.post("/v1/pods/job/stop")
    _status(api, reg, pod["id"], "Stopped", attempt=1, log_tail="wörld\nbye\n")
    api.post("/v1/pods/job/start")
    schedule()
    # the old attempt's tail is not the new one's output
    assert api.get("/v1/pods/job/logs").json()["text"] == ""
    _status(api, reg, pod["id"], "Running", attempt=2)
    _ship(api, reg, pod, 2, 0, "again\n")
    follow = api.get("/v1/pods/job/logs", params={"offset": 7, "attempt": 1}).json()
    assert (follow["text"], follow["next_offset"], follow["attempt"]) == ("bye\nagain\n", 6, 2)
    same = api.get("/v1/pods/job/logs", params={"offset": 6, "attempt": 2}).json()
    assert same["text"] == ""


def test_stop_grace_reaches_the_agent_and_old_attempt_logs_are_refused(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    reg = register_node("gpu-1")
    pod = api.post("/v1/pods", json=POD).json()
    schedule()
    _status(api, reg, pod["id"], "Running")
    assert _assignments(api, reg)["pods"][0]["stop_grace_seconds"] is None
    assert api.post("/v1/pods/job/stop", params={"grace": -1}).status_code == 422
    api.post("/v1/pods/job/stop", params={"grace": 2.5})
    assert _assignments(api, reg)["pods"][0]["stop_grace_seconds"] == 2.5
    stale = api.post(f"/v1/agent/pods/{pod['id']}/logs", headers=agent_headers(reg),
                     json={"fencing_token": 1, "attempt": 0, "offset": 0, "data": "old\n"})
    assert stale.status_code == 409
    assert api.get("/v1/pods/job/logs").json()["text"] == ""


def test_leases_are_not_expired_during_the_startup_grace(
    app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]], clock: ManualClock,
) -> None:
    register_node("gpu-1")
    clock.advance(60)
    controller = NodeLeaseController(app_ctx)
    assert controller.tick() == []
    clock.advance(app_ctx.settings.lease_ttl_seconds - 1)
    assert controller.tick() == []
    clock.advance(1)
    assert controller.tick() == ["gpu-1"]
