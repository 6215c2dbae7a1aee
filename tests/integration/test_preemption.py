"""Priorities, preemption, quotas and reclaim against a real database (SQLite and
PostgreSQL) with a manual clock: the controllers are ticked and the agents' reports made by
the test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpucloud.controllers.loops import JobController
from gpucloud.core.clock import ManualClock
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import agent_headers

Register = Callable[..., dict[str, Any]]
Tick = Callable[[], Any]


@pytest.fixture
def jobs_tick(app_ctx: ServiceContext) -> Tick:
    return JobController(app_ctx).tick


def _pod(name: str, gpus: float, cls: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"name": name, "image": "busybox", "gpus": gpus}
    return body | ({"priority_class": cls} if cls else {})


def _assignments(api: TestClient, reg: dict[str, Any]) -> list[dict[str, Any]]:
    body: list[dict[str, Any]] = api.get("/v1/agent/assignments",
                                         headers=agent_headers(reg)).json()["pods"]
    return body


def _report(api: TestClient, reg: dict[str, Any], pod: dict[str, Any], phase: str) -> None:
    response = api.post(f"/v1/agent/pods/{pod['pod_id']}/status", headers=agent_headers(reg),
                        json={"fencing_token": reg["fencing_token"], "phase": phase,
                              "attempt": pod["attempt"]})
    assert response.status_code == 200, response.text


def _agent_step(api: TestClient, *regs: dict[str, Any]) -> None:
    """What the agents do: start what is assigned, stop what is to be stopped."""
    for reg in regs:
        for pod in _assignments(api, reg):
            if pod["desired_state"] == "stopped":
                _report(api, reg, pod, "Stopped")
            elif pod["phase"] == "Scheduled":
                _report(api, reg, pod, "Running")


def _phases(api: TestClient, headers: dict[str, str] | None = None) -> dict[str, str]:
    return {p["name"]: p["phase"] for p in api.get("/v1/pods", headers=headers).json()}


def _fill(api: TestClient, schedule: Tick, regs: list[dict[str, Any]], prefix: str,
          count: int, gpus: int, cls: str, headers: dict[str, str] | None = None) -> None:
    for i in range(count):
        assert api.post("/v1/pods", json=_pod(f"{prefix}{i}", gpus, cls),
                        headers=headers).status_code == 201
    schedule()
    _agent_step(api, *regs)


def test_priority_classes_defaults_create_and_validation(api: TestClient,
                                                         app_client: TestClient) -> None:
    classes = api.get("/v1/priority-classes").json()
    assert [(c["name"], c["value"]) for c in classes] == [
        ("spot", 0), ("batch", 100), ("on-demand", 1000)]
    created = api.post("/v1/priority-classes", json={"name": "urgent", "value": 5000})
    assert created.status_code == 201 and created.json()["value"] == 5000
    assert api.post("/v1/priority-classes",
                    json={"name": "spot", "value": 1}).json()["field"] == "name"
    team = api.post("/v1/projects", json={"name": "team-a"}).json()["key"]["key"]
    denied = app_client.post("/v1/priority-classes", json={"name": "mine", "value": 1},
                             headers={"Authorization": f"Bearer {team}"})
    assert denied.status_code == 403
    pod = api.post("/v1/pods", json=_pod("fast", 1, "urgent")).json()
    assert (pod["priority_class"], pod["priority"]) == ("urgent", 5000)
    assert api.post("/v1/pods", json=_pod("x", 1)).json()["priority_class"] == "batch"
    bad = api.post("/v1/pods", json=_pod("y", 1, "nope"))
    assert bad.status_code == 422 and bad.json()["field"] == "priority_class"


def test_just_enough_spot_pods_are_preempted_and_the_capacity_is_held(
    api: TestClient, register_node: Register, schedule: Tick, clock: ManualClock
) -> None:
    node = register_node("a")
    _fill(api, schedule, [node], "spot", 4, 2, "spot")
    assert set(_phases(api).values()) == {"Running"}
    api.post("/v1/pods", json=_pod("urgent", 4, "on-demand"))
    schedule()
    urgent = api.get("/v1/pods/urgent/why").json()
    assert urgent["phase"] == "Pending" and "preempting 2 pods" in urgent["summary"]
    stopping = [p for p in api.get("/v1/pods").json() if p["desired_state"] == "stopped"]
    assert len(stopping) == 2 and all(p["reason"] == "Preempted" for p in stopping)
    events = api.get(f"/v1/pods/{stopping[0]['name']}/events").json()
    assert any(e["reason"] == "Preempted" and e["message"] == "preempted by pod urgent"
               for e in events)
    # a spot pod arriving now does not take what was freed for the preemptor
    api.post("/v1/pods", json=_pod("late", 2, "spot"))
    _agent_step(api, node)
    clock.advance(1)
    schedule()
    phases = _phases(api)
    assert phases["urgent"] == "Scheduled" and phases["late"] == "Pending"
    assert sorted(phases.values()).count("Running") == 2
    gpus = [u for p in api.get("/v1/pods").json() if p["phase"] in ("Running", "Scheduled")
            for u in p["gpu_uuids"]]
    assert len(gpus) == len(set(gpus)) == 8


@pytest.mark.parametrize("cls", ["batch", "spot"])
def test_never_for_equal_or_lower_priority(api: TestClient, register_node: Register,
                                           schedule: Tick, cls: str) -> None:
    node = register_node("a")
    _fill(api, schedule, [node], "b", 2, 4, "batch")
    api.post("/v1/pods", json=_pod("wants", 4, cls))
    schedule()
    assert api.get("/v1/pods/wants").json()["reason"] == "Unschedulable"
    assert all(p["desired_state"] == "running" for p in api.get("/v1/pods").json())


def test_an_on_demand_job_preempts_spot_pods_on_two_nodes(
    api: TestClient, register_node: Register, schedule: Tick, jobs_tick: Tick
) -> None:
    nodes = [register_node(n, address=f"127.0.0.{i + 2}") for i, n in enumerate("abc")]
    _fill(api, schedule, nodes, "spot", 12, 2, "spot")
    api.post("/v1/jobs", json={"name": "train", "image": "busybox", "nodes": 2,
                               "gpus_per_node": 8, "priority_class": "on-demand"})
    jobs_tick()
    assert "preempting 8 pods" in api.get("/v1/jobs/train/why").json()["summary"]
    _agent_step(api, *nodes)
    jobs_tick()
    job = api.get("/v1/jobs/train").json()
    assert [m["phase"] for m in job["members"]] == ["Scheduled", "Scheduled"]
    stopped = [p for p in api.get("/v1/pods").json() if p["phase"] == "Stopped"]
    assert len(stopped) == 8
    assert {(p["reason"], p["message"]) for p in stopped} == {
        ("Preempted", "preempted by job train")}


def test_a_preempted_job_is_requeued_whole(api: TestClient, register_node: Register,
                                           schedule: Tick, jobs_tick: Tick) -> None:
    nodes = [register_node(n, address=f"127.0.0.{i + 2}") for i, n in enumerate("ab")]
    api.post("/v1/jobs", json={"name": "cheap", "image": "busybox", "nodes": 2,
                               "gpus_per_node": 8, "priority_class": "spot"})
    jobs_tick()
    api.post("/v1/pods", json=_pod("urgent", 8, "on-demand"))
    schedule()
    job = api.get("/v1/jobs/cheap").json()
    assert job["phase"] == "Pending" and "preempted by pod urgent" in job["message"]
    _agent_step(api, *nodes)
    jobs_tick()
    schedule()
    assert _phases(api)["urgent"] == "Scheduled"
    assert api.get("/v1/jobs/cheap").json()["restarts"] == 0


def _project(api: TestClient, name: str) -> dict[str, str]:
    key = api.post("/v1/projects", json={"name": name}).json()["key"]["key"]
    return {"Authorization": f"Bearer {key}"}


def test_work_over_quota_waits_and_why_says_so(api: TestClient, register_node: Register,
                                               schedule: Tick) -> None:
    register_node("a")
    register_node("b")
    team = _project(api, "team-a")
    quota = api.put("/v1/quotas/team-a", json={"gpus": {"h100": 8}, "borrow_limit": 0})
    assert quota.status_code == 200 and quota.json()["gpus"] == {"H100-80GB": 8}
    for name in ("one", "two"):
        api.post("/v1/pods", json=_pod(name, 8), headers=team)
    schedule()
    assert _phases(api, team) == {"one": "Scheduled", "two": "Pending"}
    why = api.get("/v1/pods/two/why", headers=team).json()["summary"]
    assert why.startswith("over quota: project team-a uses 8/8 H100-80GB GPUs, borrow limit 0")
    listed = api.get("/v1/quotas").json()
    assert listed[0]["project"] == "team-a" and listed[0]["used"] == {"H100-80GB": 8}
    api.put("/v1/quotas/team-a", json={"gpus": {"h100": 8}, "borrow_limit": 8})
    schedule()  # the back-off of an over-quota pod is not over yet
    assert _phases(api, team)["two"] == "Pending"


def test_the_owner_reclaims_borrowed_work_and_a_borrower_cannot(
    api: TestClient, register_node: Register, schedule: Tick
) -> None:
    nodes = [register_node("a"), register_node("b")]
    owner, borrower = _project(api, "owner"), _project(api, "borrower")
    api.put("/v1/quotas/owner", json={"gpus": {"H100-80GB": 8}})
    _fill(api, schedule, nodes, "lent", 2, 8, "spot", borrower)
    assert set(_phases(api, borrower).values()) == {"Running"}
    # the owner, within its quota, takes its GPUs back from the borrower
    api.post("/v1/pods", json=_pod("mine", 8, "batch"), headers=owner)
    schedule()
    assert sum(p["desired_state"] == "stopped"
               for p in api.get("/v1/pods", headers=borrower).json()) == 1
    _agent_step(api, *nodes)
    schedule()
    _agent_step(api, *nodes)
    assert _phases(api, owner) == {"mine": "Running"}


def test_an_owner_reclaims_borrowed_work_of_its_own_class(
    api: TestClient, register_node: Register, schedule: Tick
) -> None:
    nodes = [register_node("a"), register_node("b")]
    owner, borrower = _project(api, "owner"), _project(api, "borrower")
    api.put("/v1/quotas/owner", json={"gpus": {"H100-80GB": 8}, "borrow_limit": 8})
    api.put("/v1/quotas/borrower", json={"gpus": {"H100-80GB": 4}, "borrow_limit": 12})
    _fill(api, schedule, nodes, "lent", 4, 4, "batch", borrower)  # 12 of its 16 borrowed
    api.post("/v1/pods", json=_pod("mine", 8, "batch"), headers=owner)
    schedule()
    why = api.get("/v1/pods/mine/why", headers=owner).json()["summary"]
    assert why.startswith("preempting 2 pods running on borrowed quota on ")
    stopping = [p for p in api.get("/v1/pods", headers=borrower).json()
                if p["desired_state"] == "stopped"]
    assert {p["message"] for p in stopping} == {
        "preempted by pod mine to reclaim its project's quota"}
    assert len({p["node"] for p in stopping}) == 1
    _agent_step(api, *nodes)
    schedule()
    _agent_step(api, *nodes)
    assert _phases(api, owner) == {"mine": "Running"}
    # beyond its quota the owner borrows like anyone else, and takes nothing back
    api.post("/v1/pods", json=_pod("more", 4, "batch"), headers=owner)
    schedule()
    assert api.get("/v1/pods/more", headers=owner).json()["reason"] == "Unschedulable"
    assert sorted(_phases(api, borrower).values()) == ["Running", "Running", "Stopped",
                                                      "Stopped"]


def test_a_job_within_its_quota_reclaims_a_borrowed_gang_of_its_own_class(
    api: TestClient, register_node: Register, jobs_tick: Tick
) -> None:
    nodes = [register_node(n, address=f"127.0.0.{i + 2}") for i, n in enumerate("ab")]
    owner, borrower = _project(api, "owner"), _project(api, "borrower")
    api.put("/v1/quotas/owner", json={"gpus": {"H100-80GB": 16}})
    job = {"image": "busybox", "nodes": 2, "gpus_per_node": 8}
    api.post("/v1/jobs", json=job | {"name": "lent"}, headers=borrower)
    jobs_tick()
    _agent_step(api, *nodes)
    api.post("/v1/jobs", json=job | {"name": "train"}, headers=owner)
    jobs_tick()
    assert "2 pods running on borrowed quota" in api.get(
        "/v1/jobs/train/why", headers=owner).json()["summary"]
    assert api.get("/v1/jobs/lent", headers=borrower).json()["message"] == (
        "preempted by job train to reclaim its project's quota")
    _agent_step(api, *nodes)
    jobs_tick()
    trained = api.get("/v1/jobs/train", headers=owner).json()
    assert [m["phase"] for m in trained["members"]] == ["Scheduled", "Scheduled"]
    # requeued, the borrowed gang waits: it may not take the owner's quota in turn
    jobs_tick()
    assert api.get("/v1/jobs/lent", headers=borrower).json()["phase"] == "Pending"
    assert [m["phase"] for m in api.get("/v1/jobs/train", headers=owner).json()["members"]
            ] == ["Scheduled", "Scheduled"]


def test_a_borrower_never_preempts_work_within_a_quota(
    api: TestClient, register_node: Register, schedule: Tick
) -> None:
    node = register_node("a")
    owner, borrower = _project(api, "owner"), _project(api, "borrower")
    api.put("/v1/quotas/owner", json={"gpus": {"H100-80GB": 8}})
    _fill(api, schedule, [node], "cheap", 1, 8, "spot", owner)
    api.post("/v1/pods", json=_pod("greedy", 8, "on-demand"), headers=borrower)
    schedule()
    assert api.get("/v1/pods/greedy", headers=borrower).json()["reason"] == "Unschedulable"
    assert [p["desired_state"] for p in api.get("/v1/pods", headers=owner).json()] == [
        "running"]
    # without the quota the same spot pod is fair game
    api.put("/v1/quotas/owner", json={"gpus": {}})
    api.post("/v1/pods", json=_pod("greedy-again", 8, "on-demand"), headers=borrower)
    schedule()
    assert api.get("/v1/pods/cheap0", headers=owner).json()["reason"] == "Preempted"


def test_drf_orders_equal_priority_work_by_dominant_share_cpu_included(
    api: TestClient, register_node: Register, schedule: Tick
) -> None:
    node = register_node("a", cpu=64)
    heavy, light = _project(api, "heavy"), _project(api, "light")
    cpu_only = {"name": "crunch", "image": "busybox", "gpus": 0, "cpu": 32}
    assert api.post("/v1/pods", json=cpu_only, headers=heavy).status_code == 201
    schedule()
    _agent_step(api, node)
    # heavy holds no GPU but half the CPU: its older GPU pod waits behind light's
    api.post("/v1/pods", json=_pod("first", 8), headers=heavy)
    api.post("/v1/pods", json=_pod("second", 8), headers=light)
    schedule()
    assert _phases(api, light) == {"second": "Scheduled"}
    assert _phases(api, heavy) == {"crunch": "Running", "first": "Pending"}
