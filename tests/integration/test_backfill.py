"""Backfill and max durations against a real database (SQLite and PostgreSQL) with a manual
clock: the controllers are ticked and the agents' reports made by the test.

Three 8-GPU nodes: ``long`` (no max duration) fills one for ever; ``short-a`` (8 GPUs) and
``short-b`` (4 GPUs) fill the two others until T0 + 600 s. A 2 x 8-GPU job is blocked and
gets those two nodes reserved from T0 + 600 s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpucloud.controllers.loops import JobController, MaxDurationController
from gpucloud.core.clock import ManualClock
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import h100_gpus
from tests.integration.test_preemption import _agent_step, _phases

Register = Callable[..., dict[str, Any]]
Tick = Callable[[], Any]


@pytest.fixture
def jobs_tick(app_ctx: ServiceContext) -> Tick:
    return JobController(app_ctx).tick


@pytest.fixture
def deadlines(app_ctx: ServiceContext) -> Tick:
    return MaxDurationController(app_ctx).tick


def _pod(api: TestClient, name: str, gpus: int, max_duration: float | str | None,
         **extra: Any) -> None:
    body: dict[str, Any] = {"name": name, "image": "busybox", "gpus": gpus, **extra}
    if max_duration is not None:
        body["max_duration"] = max_duration
    response = api.post("/v1/pods", json=body)
    assert response.status_code == 201, response.text


def _node_of(api: TestClient, pod: str) -> str:
    node: str = api.get(f"/v1/pods/{pod}").json()["node"]
    return node


@pytest.fixture
def blocked(api: TestClient, register_node: Register, schedule: Tick,
            jobs_tick: Tick) -> list[dict[str, Any]]:
    """The cluster of the module docstring, with the job ``big`` blocked; the nodes."""
    nodes = [register_node(n, address=f"127.0.0.{i + 2}") for i, n in enumerate("abc")]
    _pod(api, "long", 8, None)
    _pod(api, "short-a", 8, 600)
    _pod(api, "short-b", 4, "10m")
    schedule()
    _agent_step(api, *nodes)
    assert set(_phases(api).values()) == {"Running"}
    api.post("/v1/jobs", json={"name": "big", "image": "busybox", "nodes": 2,
                               "gpus_per_node": 8})
    jobs_tick()
    return nodes


def test_max_duration_is_parsed_validated_and_shown(api: TestClient) -> None:
    _pod(api, "two-hours", 1, "2h")
    assert api.get("/v1/pods/two-hours").json()["max_duration"] == 7200
    bad = api.post("/v1/pods", json={"name": "x", "image": "busybox", "max_duration": "soon"})
    assert bad.status_code == 422 and bad.json()["field"] == "max_duration"
    job = api.post("/v1/jobs", json={"name": "j", "image": "busybox", "nodes": 1,
                                     "gpus_per_node": 1, "max_duration": 90}).json()
    assert job["max_duration"] == 90
    assert api.get("/v1/pods/j-0").json()["max_duration"] == 90


def test_a_blocked_gang_is_reserved_backfilled_in_time_and_starts_at_its_time(
    api: TestClient, blocked: list[dict[str, Any]], schedule: Tick, jobs_tick: Tick,
    deadlines: Tick, clock: ManualClock
) -> None:
    reserved = {_node_of(api, "short-a"), _node_of(api, "short-b")}
    why = api.get("/v1/jobs/big/why").json()["summary"]
    assert f"nodes {', '.join(sorted(reserved))} reserved for it from " in why, why

    _pod(api, "endless", 4, None)   # would fit beside short-b, but could delay big
    _pod(api, "quick", 4, 300)      # ends by the reserved start: backfills there
    _pod(api, "slow", 4, 900)       # would end after it
    schedule()
    _agent_step(api, *blocked)
    phases = _phases(api)
    assert (phases["quick"], _node_of(api, "quick")) == ("Running", _node_of(api, "short-b"))
    assert phases["endless"] == phases["slow"] == "Pending"
    for name in ("endless", "slow"):
        summary = api.get(f"/v1/pods/{name}/why").json()["summary"]
        assert "reserved for job big from " in summary, summary

    clock.advance(300)
    assert deadlines() and api.get("/v1/pods/quick").json()["desired_state"] == "stopped"
    _agent_step(api, *blocked)
    quick = api.get("/v1/pods/quick").json()
    assert (quick["phase"], quick["reason"]) == ("Stopped", "MaxDurationExceeded")
    schedule()
    assert _phases(api)["endless"] == "Pending"   # still reserved for big

    clock.advance(299)
    jobs_tick()
    assert api.get("/v1/jobs/big").json()["members"][0]["node"] is None
    clock.advance(1)
    deadlines()
    _agent_step(api, *blocked)
    jobs_tick()
    schedule()
    job = api.get("/v1/jobs/big").json()
    assert {m["node"] for m in job["members"]} == reserved
    assert _phases(api)["endless"] == "Pending"
    assert {api.get(f"/v1/pods/{p}").json()["reason"] for p in ("short-a", "short-b")} == {
        "MaxDurationExceeded"}


def test_later_jobs_backfill_only_when_they_end_in_time(
    api: TestClient, blocked: list[dict[str, Any]], jobs_tick: Tick
) -> None:
    for name, max_duration in (("open-ended", None), ("brief", 120)):
        api.post("/v1/jobs", json={"name": name, "image": "busybox", "nodes": 1,
                                   "gpus_per_node": 4, "max_duration": max_duration})
    jobs_tick()
    brief = api.get("/v1/jobs/brief").json()
    assert brief["members"][0]["node"] == _node_of(api, "short-b")
    open_ended = api.get("/v1/jobs/open-ended").json()
    assert open_ended["phase"] == "Pending" and open_ended["members"][0]["node"] is None
    why = api.get("/v1/jobs/open-ended/why").json()
    assert "reserved for job big from " in why["summary"], why


def test_work_that_outranks_the_gang_may_use_its_reserved_nodes(
    api: TestClient, blocked: list[dict[str, Any]], schedule: Tick
) -> None:
    api.post("/v1/pods", json={"name": "urgent", "image": "busybox", "gpus": 4,
                               "priority_class": "on-demand"})
    schedule()
    assert api.get("/v1/pods/urgent").json()["node"] == _node_of(api, "short-b")


def test_preemption_takes_reserved_nodes_only_for_work_that_outranks_the_gang(
    api: TestClient, blocked: list[dict[str, Any]], schedule: Tick
) -> None:
    pod = {"image": "busybox", "gpus": 4}
    api.post("/v1/pods", json=pod | {"name": "cheap", "max_duration": 300,
                                     "priority_class": "spot"})
    schedule()
    _agent_step(api, *blocked)
    assert _node_of(api, "cheap") == _node_of(api, "short-b")
    # a batch pod without a max duration outranks cheap but not big: no preemption there
    api.post("/v1/pods", json=pod | {"name": "later"})
    schedule()
    assert api.get("/v1/pods/later").json()["reason"] == "Unschedulable"
    assert api.get("/v1/pods/cheap").json()["desired_state"] == "running"
    # an on-demand pod outranks both
    api.post("/v1/pods", json=pod | {"name": "urgent", "priority_class": "on-demand"})
    schedule()
    assert api.get("/v1/pods/cheap").json()["desired_state"] == "stopped"
    assert api.get("/v1/pods/urgent").json()["reason"] == "Preempting"


def test_a_job_past_its_max_duration_is_stopped_whole(
    api: TestClient, register_node: Register, jobs_tick: Tick, deadlines: Tick,
    clock: ManualClock
) -> None:
    nodes = [register_node(n, address=f"127.0.0.{i + 2}") for i, n in enumerate("ab")]
    api.post("/v1/jobs", json={"name": "run", "image": "busybox", "nodes": 2,
                               "gpus_per_node": 8, "max_duration": "1m"})
    jobs_tick()
    for node in nodes:
        for pod in api.get("/v1/agent/assignments", headers=_headers(node)).json()["pods"]:
            api.post(f"/v1/agent/pods/{pod['pod_id']}/ready", headers=_headers(node),
                     json={"fencing_token": node["fencing_token"], "attempt": pod["attempt"]})
    jobs_tick()
    _agent_step(api, *nodes)
    assert api.get("/v1/jobs/run").json()["phase"] == "Running"
    clock.advance(59)
    assert deadlines() == []
    clock.advance(1)
    assert len(deadlines()) == 1
    _agent_step(api, *nodes)
    jobs_tick()
    job = api.get("/v1/jobs/run").json()
    assert (job["phase"], job["reason"]) == ("Stopped", "MaxDurationExceeded")
    assert job["message"] == "ran longer than its max duration (60s)"


def test_a_same_rack_gang_is_reserved_within_one_rack(
    api: TestClient, register_node: Register, schedule: Tick, jobs_tick: Tick
) -> None:
    """a, b in rack r1 and c, d in r2; the two earliest-freed nodes (a at 100 s, c at
    200 s) are in different racks, so the reservation is r2's: c and d, from 300 s."""
    racks = {"a": "r1", "b": "r1", "c": "r2", "d": "r2"}
    nodes = [register_node(n, address=f"127.0.0.{i + 2}", labels={"rack": rack})
             for i, (n, rack) in enumerate(racks.items())]
    for name, seconds in (("a", 100), ("c", 200), ("d", 300), ("b", 400)):
        for other in racks:
            api.post(f"/v1/nodes/{other}/{'uncordon' if other == name else 'cordon'}")
        _pod(api, f"on-{name}", 8, seconds)
        schedule()
        assert _node_of(api, f"on-{name}") == name
    _agent_step(api, *nodes)
    for name in racks:
        api.post(f"/v1/nodes/{name}/uncordon")
    api.post("/v1/jobs", json={"name": "big", "image": "busybox", "nodes": 2,
                               "gpus_per_node": 8, "topology": "same-rack"})
    jobs_tick()
    why = api.get("/v1/jobs/big/why").json()["summary"]
    assert "nodes c, d reserved for it from " in why, why


def test_a_gang_blocked_by_cpu_alone_is_reserved_and_backfilled_around(
    api: TestClient, register_node: Register, schedule: Tick, jobs_tick: Tick,
    deadlines: Tick, clock: ManualClock
) -> None:
    """Three 64-core nodes with all their GPUs free: CPU-only pods take 48 cores of two
    until T0 + 600 s and all of the third for ever. A 2 x 8-GPU job asking 32 cores a
    member fits by GPU counts now, but only the two nodes freeing at 600 s can take it."""
    nodes = [register_node(n, address=f"127.0.0.{i + 2}") for i, n in enumerate("abc")]
    for name, cores, max_duration in (("cpu-x", 48, 600), ("cpu-y", 48, "10m"),
                                      ("cpu-z", 64, None)):
        _pod(api, name, 0, max_duration, cpu=cores)
        schedule()
    _agent_step(api, *nodes)
    assert set(_phases(api).values()) == {"Running"}
    api.post("/v1/jobs", json={"name": "big", "image": "busybox", "nodes": 2,
                               "gpus_per_node": 8, "cpu": 32})
    jobs_tick()
    reserved = {_node_of(api, "cpu-x"), _node_of(api, "cpu-y")}
    why = api.get("/v1/jobs/big/why").json()["summary"]
    assert f"nodes {', '.join(sorted(reserved))} reserved for it from " in why, why

    _pod(api, "endless", 1, None, cpu=8)   # fits beside cpu-x or cpu-y, but could delay big
    _pod(api, "quick", 1, 300, cpu=8)      # ends by the reserved start: backfills there
    schedule()
    _agent_step(api, *nodes)
    assert (_phases(api)["quick"], _node_of(api, "quick") in reserved) == ("Running", True)
    assert _phases(api)["endless"] == "Pending"
    summary = api.get("/v1/pods/endless/why").json()["summary"]
    assert "reserved for job big from " in summary, summary

    clock.advance(600)
    deadlines()
    _agent_step(api, *nodes)
    jobs_tick()
    assert {m["node"] for m in api.get("/v1/jobs/big").json()["members"]} == reserved


def test_gpus_of_another_model_do_not_count_against_the_gang(
    api: TestClient, register_node: Register, schedule: Tick, jobs_tick: Tick
) -> None:
    """Two nodes of 4 H100 and 4 A100 GPUs; A100 pods hold the A100s of both for ever, an
    H100 pod a's H100s until T0 + 600 s. A 2 x 4 H100 job can start then: the A100s it
    never asked for do not keep it waiting for ever."""
    a100 = [{"uuid": f"GPU-A{i:07d}-test", "model": "NVIDIA A100-SXM4-80GB",
             "memory_mib": 81920, "numa_node": 1, "nvlink_peers": []} for i in range(4)]
    nodes = [register_node(n, gpus=[*h100_gpus(4), *a100], address=f"127.0.0.{i + 2}")
             for i, n in enumerate("ab")]
    api.post("/v1/nodes/b/cordon")
    _pod(api, "h100-on-a", 4, 600, gpu_type="h100")
    schedule()
    api.post("/v1/nodes/b/uncordon")
    for name in ("a100-x", "a100-y"):
        _pod(api, name, 4, None, gpu_type="A100-80GB")
        schedule()
    _agent_step(api, *nodes)
    assert set(_phases(api).values()) == {"Running"} and _node_of(api, "h100-on-a") == "a"
    api.post("/v1/jobs", json={"name": "big", "image": "busybox", "nodes": 2,
                               "gpus_per_node": 4, "gpu_type": "h100"})
    jobs_tick()
    why = api.get("/v1/jobs/big/why").json()["summary"]
    assert "nodes a, b reserved for it from " in why, why


def _headers(node: dict[str, Any]) -> dict[str, str]:
    return {"Authorization": f"Bearer {node['node_token']}"}
