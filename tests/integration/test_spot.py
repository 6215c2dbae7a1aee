"""Spot pods, preemption notices, node drain and lost nodes against a real database
(SQLite and PostgreSQL) with a manual clock: controllers are ticked and the agents'
reports made by the test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from gpucloud.core.clock import ManualClock
from gpucloud.services import drain
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import agent_headers

Register = Callable[..., dict[str, Any]]
Tick = Callable[[], Any]


def _assigned(api: TestClient, reg: dict[str, Any]) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = api.get("/v1/agent/assignments",
                                         headers=agent_headers(reg)).json()["pods"]
    return pods


def _report(api: TestClient, reg: dict[str, Any], pod: dict[str, Any], phase: str,
            exit_code: int | None = None) -> None:
    response = api.post(f"/v1/agent/pods/{pod['pod_id']}/status", headers=agent_headers(reg),
                        json={"fencing_token": reg["fencing_token"], "phase": phase,
                              "attempt": pod["attempt"], "exit_code": exit_code})
    assert response.status_code == 200, response.text


def _run_all(api: TestClient, *regs: dict[str, Any]) -> None:
    """The agents: start what is scheduled, stop what is to be stopped."""
    for reg in regs:
        for pod in _assigned(api, reg):
            if pod["desired_state"] == "stopped":
                _report(api, reg, pod, "Stopped")
            elif pod["phase"] == "Scheduled":
                _report(api, reg, pod, "Running")


def _pod(api: TestClient, name: str) -> dict[str, Any]:
    body: dict[str, Any] = api.get(f"/v1/pods/{name}").json()
    return body


def test_spot_is_the_spot_class_with_a_bid_and_bad_input_names_the_field(
        api: TestClient) -> None:
    pod = api.post("/v1/pods", json={"name": "s", "image": "busybox", "gpus": 1,
                                     "spot": True, "bid": 1.25, "grace": 5}).json()
    assert (pod["priority_class"], pod["priority"], pod["spot"], pod["bid"], pod["grace"]) \
        == ("spot", 0, True, 1.25, 5)
    assert (pod["preemptions"], pod["last_preemption_reason"]) == (0, None)
    for body, field in (({"spot": True, "priority_class": "on-demand"}, "priority_class"),
                        ({"bid": 2.0}, "bid"), ({"spot": True, "bid": -1}, "bid"),
                        ({"priority_class": "nope"}, "priority_class"),
                        ({"spot": True, "grace": -1}, "grace")):
        bad = api.post("/v1/pods", json={"name": "x", "image": "busybox", **body})
        assert bad.status_code == 422 and bad.json()["field"] == field, (body, bad.text)
    assert [p["name"] for p in api.get("/v1/pods").json()] == ["s"]


def test_a_preempted_spot_pod_gets_its_notice_is_counted_and_restarts_elsewhere(
        api: TestClient, register_node: Register, schedule: Tick, clock: ManualClock) -> None:
    a = register_node("a")
    api.post("/v1/pods", json={"name": "cheap", "image": "busybox", "gpus": 8,
                               "spot": True, "grace": 20})
    schedule()
    _run_all(api, a)
    clock.advance(100)
    b = register_node("b", gpus=[])  # no GPUs: the preemptor must take node a
    api.post("/v1/pods", json={"name": "urgent", "image": "busybox", "gpus": 8,
                               "priority_class": "on-demand"})
    schedule()
    (noticed,) = [p for p in _assigned(api, a) if p["name"] == "cheap"]
    assert noticed["desired_state"] == "stopped" and noticed["stop_grace_seconds"] == 20
    notice = noticed["stop_notice"]
    assert (notice["reason"], notice["attempt"], notice["grace_seconds"]) == (
        "spot", noticed["attempt"], 20)
    cheap = _pod(api, "cheap")
    assert (cheap["preemptions"], cheap["last_preemption_reason"]) == (1, "spot")
    assert cheap["time_lost_seconds"] == 100  # ran 100 s, no checkpoint
    _report(api, a, noticed, "Stopped", exit_code=75)  # acknowledged: "requeue me"
    cheap = _pod(api, "cheap")
    assert (cheap["phase"], cheap["reason"]) == ("Pending", "Requeued"), cheap
    events = api.get("/v1/pods/cheap/events").json()
    # one preemption: one notice; the phase change to Stopped keeps the reason
    assert [e["reason"] for e in events if e["to_phase"] is None].count("Preempted") == 1
    assert [e["reason"] for e in events].count("PreemptionNotice") == 1
    clock.advance(1)
    schedule()
    assert _pod(api, "urgent")["node"] == "a"
    # urgent leaves; cheap could fit on a again but stays off it for a while
    api.post("/v1/pods/urgent/stop")
    _run_all(api, a, b)
    clock.advance(10)
    schedule()
    why = api.get("/v1/pods/cheap/why").json()
    assert _pod(api, "cheap")["phase"] == "Pending"
    assert "just preempted from node a" in str(why), why
    clock.advance(300)
    schedule()
    assert (_pod(api, "cheap")["phase"], _pod(api, "cheap")["node"]) == ("Scheduled", "a")


def test_a_preempted_on_demand_pod_without_restart_stays_stopped(
        api: TestClient, register_node: Register, schedule: Tick) -> None:
    a = register_node("a")
    api.post("/v1/pods", json={"name": "low", "image": "busybox", "gpus": 8,
                               "priority_class": "batch"})
    schedule()
    _run_all(api, a)
    api.post("/v1/pods", json={"name": "hi", "image": "busybox", "gpus": 8,
                               "priority_class": "on-demand"})
    schedule()
    (low,) = [p for p in _assigned(api, a) if p["name"] == "low"]
    assert low["stop_notice"]["reason"] == "priority"
    _run_all(api, a)
    pod = _pod(api, "low")
    assert (pod["phase"], pod["reason"], pod["preemptions"]) == ("Stopped", "Preempted", 1)


def test_drain_notices_moves_and_ends_drained_then_undrain(
        api: TestClient, app_ctx: ServiceContext, register_node: Register, schedule: Tick,
        clock: ManualClock) -> None:
    a, b = register_node("a"), register_node("b")
    for name in ("p1", "p2"):
        api.post("/v1/pods", json={"name": name, "image": "busybox", "gpus": 4})
    schedule()
    _run_all(api, a, b)
    on_a = [p["name"] for p in api.get("/v1/pods").json() if p["node"] == "a"]
    assert on_a
    assert api.post("/v1/nodes/a/drain", json={"deadline": "nope"}).json()["field"] \
        == "deadline"
    node = api.post("/v1/nodes/a/drain", json={"deadline": "60s"}).json()
    assert (node["status"], node["cordoned"], node["drain"]["state"]) == (
        "Draining", True, "draining")
    assert node["drain"]["pods_total"] == len(on_a) == node["drain"]["pods_left"]
    noticed = _assigned(api, a)
    assert all(p["stop_notice"]["reason"] == "drain" for p in noticed), noticed
    _run_all(api, a)  # they stop; requeued, placed on b
    drain.tick(app_ctx)
    node = api.get("/v1/nodes/a").json()
    assert (node["status"], node["drain"]["pods_left"]) == ("Drained", 0), node
    schedule()
    for name in on_a:
        pod = _pod(api, name)
        assert (pod["node"], pod["last_preemption_reason"]) == ("b", "drain"), pod
    undrained = api.post("/v1/nodes/a/undrain").json()
    assert (undrained["status"], undrained["cordoned"], undrained["drain"]) == (
        "Ready", False, None)


def test_drain_deadline_stops_what_is_left_and_only_one_node_drains_at_once(
        api: TestClient, app_ctx: ServiceContext, register_node: Register, schedule: Tick,
        clock: ManualClock) -> None:
    a, b, _c = register_node("a"), register_node("b"), register_node("c")
    for name in ("p1", "p2"):
        api.post("/v1/pods", json={"name": name, "image": "busybox", "gpus": 8})
    schedule()
    _run_all(api, a, b)
    first = api.post("/v1/nodes/a/drain", json={"deadline": 30}).json()
    second = api.post("/v1/nodes/b/drain", json={"deadline": 30}).json()
    assert first["drain"]["state"] == "draining"
    assert (second["status"], second["drain"]["state"]) == ("Draining", "waiting")
    assert all(p["stop_notice"] is None for p in _assigned(api, b))
    clock.advance(29)
    drain.tick(app_ctx)
    assert api.get("/v1/nodes/a").json()["drain"]["pods_left"] == 1  # the agent is silent
    clock.advance(2)
    drain.tick(app_ctx)  # deadline: stopped here, requeued; b's drain starts
    assert api.get("/v1/nodes/a").json()["status"] == "Drained"
    assert _assigned(api, a) == []  # the agent kills what is no longer assigned
    assert api.get("/v1/nodes/b").json()["drain"]["state"] == "draining"
    moved = next(p for p in api.get("/v1/pods").json() if p["last_preemption_reason"])
    assert moved["phase"] == "Pending" and moved["preemptions"] == 1
    schedule()
    assert _pod(api, moved["name"])["node"] == "c"


def test_a_spot_pod_lost_with_its_node_restarts_elsewhere_recorded_as_node_lost(
        api: TestClient, register_node: Register, schedule: Tick, clock: ManualClock,
        expire_leases: Callable[[], list[str]]) -> None:
    a = register_node("a")
    api.post("/v1/pods", json={"name": "s", "image": "busybox", "gpus": 8, "spot": True})
    api.post("/v1/pods", json={"name": "plain", "image": "busybox", "gpus": 0})
    schedule()
    _run_all(api, a)
    clock.advance(60)
    assert expire_leases() == ["a"]
    spot, plain = _pod(api, "s"), _pod(api, "plain")
    assert (spot["phase"], spot["last_preemption_reason"], spot["preemptions"]) == (
        "Pending", "node-lost", 1)
    assert plain["phase"] == "Lost" and plain["last_preemption_reason"] == "node-lost"
    assert "NodeLost" in [e["reason"] for e in api.get("/v1/pods/s/events").json()]
    register_node("b")
    schedule()
    assert _pod(api, "s")["node"] == "b"
