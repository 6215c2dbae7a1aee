"""Jobs as gangs against a real database (SQLite and PostgreSQL) with a manual clock:
all-or-nothing placement, rendezvous env, the start barrier, ready timeout, gang restarts."""

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


@pytest.fixture
def jobs_tick(app_ctx: ServiceContext) -> Callable[[], Any]:
    """One pass of the job controller: reconcile, then place queued jobs."""
    return JobController(app_ctx).tick


def _job(name: str, nodes: int = 2, **fields: Any) -> dict[str, Any]:
    return {"name": name, "image": "busybox", "command": ["true"], "nodes": nodes,
            "gpus_per_node": 8, **fields}


def _cluster(register: Register, names: str = "abc", **labels: dict[str, str]) -> dict[
        str, dict[str, Any]]:
    """Nodes named by letter with address 127.0.0.<i+2> and the given labels."""
    return {name: register(name, address=f"127.0.0.{i + 2}", labels=labels.get(name, {}))
            for i, name in enumerate(names)}


def _assignments(api: TestClient, reg: dict[str, Any]) -> list[dict[str, Any]]:
    body: list[dict[str, Any]] = api.get("/v1/agent/assignments",
                                         headers=agent_headers(reg)).json()["pods"]
    return body


def _report(api: TestClient, reg: dict[str, Any], pod: dict[str, Any], phase: str,
            **extra: Any) -> None:
    response = api.post(f"/v1/agent/pods/{pod['pod_id']}/status", headers=agent_headers(reg),
                        json={"fencing_token": reg["fencing_token"], "phase": phase,
                              "attempt": pod["attempt"], **extra})
    assert response.status_code == 200, response.text


def _ready(api: TestClient, reg: dict[str, Any], pod: dict[str, Any]) -> int:
    return api.post(f"/v1/agent/pods/{pod['pod_id']}/ready", headers=agent_headers(reg),
                    json={"fencing_token": reg["fencing_token"],
                          "attempt": pod["attempt"]}).status_code


def _members(api: TestClient, job: str) -> list[dict[str, Any]]:
    body: list[dict[str, Any]] = api.get(f"/v1/jobs/{job}").json()["members"]
    return body


def _placed(api: TestClient, nodes: dict[str, dict[str, Any]],
            job: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(node registration, assignment) of every member, by rank."""
    found = []
    for member in _members(api, job):
        reg = nodes[member["node"]]
        found.append((reg, next(a for a in _assignments(api, reg)
                                if a["pod_id"] == member["pod_id"])))
    return found


def _start(api: TestClient, nodes: dict[str, dict[str, Any]], job: str,
           tick: Callable[[], Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Place the job, report every member ready, release the barrier."""
    tick()
    placed = _placed(api, nodes, job)
    for reg, pod in placed:
        assert _ready(api, reg, pod) == 200
    tick()
    return _placed(api, nodes, job)


def test_members_get_distinct_nodes_and_the_rendezvous_env(
    api: TestClient, register_node: Register, jobs_tick: Callable[[], Any]
) -> None:
    nodes = _cluster(register_node)
    created = api.post("/v1/jobs", json=_job("train", env={"EPOCHS": "3"}))
    assert created.status_code == 201, created.text
    assert [m["pod"] for m in created.json()["members"]] == ["train-0", "train-1"]
    jobs_tick()
    members = _members(api, "train")
    assert len({m["node"] for m in members}) == 2
    placed = _placed(api, nodes, "train")
    addresses = [m["address"] for m in members]
    port = str(api.get("/v1/jobs/train").json()["master_port"])
    for rank, (_, pod) in enumerate(placed):
        env = pod["env"]
        assert pod["host_network"] and pod["barrier"] and not pod["barrier_released"]
        assert env["EPOCHS"] == "3"
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (addresses[0], port)
        assert (env["PET_MASTER_ADDR"], env["PET_MASTER_PORT"]) == (addresses[0], port)
        assert env["PET_NODE_RANK"] == env["GPUCLOUD_NODE_RANK"] == str(rank)
        assert env["PET_NNODES"] == env["GPUCLOUD_NUM_NODES"] == "2"
        assert env["PET_NPROC_PER_NODE"] == env["GPUCLOUD_GPUS_PER_NODE"] == "8"
        assert env["GPUCLOUD_NODE_IPS"] == "\n".join(addresses)
        assert len(pod["gpu_uuids"]) == 8


def test_a_gang_that_does_not_fit_places_nothing_and_why_explains(
    api: TestClient, register_node: Register, jobs_tick: Callable[[], Any],
    schedule: Callable[[], Any]
) -> None:
    _cluster(register_node)
    api.post("/v1/jobs", json=_job("big", nodes=4))
    jobs_tick()
    job = api.get("/v1/jobs/big").json()
    assert job["phase"] == "Pending"
    assert all(m["phase"] == "Pending" and m["node"] is None for m in job["members"])
    why = api.get("/v1/jobs/big/why").json()
    assert why["summary"] == "needs 4 nodes with 8 free GPUs each, 3 have them"
    assert why["reasons"] == {"free for a member": 3}
    schedule()  # the pod pass leaves members alone
    assert all(p["phase"] == "Pending" for p in api.get("/v1/pods").json())
    assert sum(n["gpus_allocated"] for n in api.get("/v1/nodes").json()) == 0


def test_topology_prefers_the_tightest_domain_and_is_never_broken(
    api: TestClient, register_node: Register, jobs_tick: Callable[[], Any]
) -> None:
    _cluster(register_node, "abcd", a={"block": "b1", "rack": "r1"},
             b={"block": "b2", "rack": "r1"}, c={"block": "b2", "rack": "r2"},
             d={"rack": "r2"})
    api.post("/v1/jobs", json=_job("near"))
    jobs_tick()
    assert {m["node"] for m in _members(api, "near")} == {"b", "c"}  # block b2
    api.post("/v1/jobs", json=_job("rack", topology="same-rack"))
    api.post("/v1/jobs", json=_job("block", topology="same-block"))
    jobs_tick()
    assert {m["node"] for m in _members(api, "rack")} == {None}  # r1, r2: one free each
    assert "same-rack" in api.get("/v1/jobs/rack/why").json()["summary"]
    assert all(m["node"] is None for m in _members(api, "block"))


def test_the_barrier_releases_all_members_at_once(
    api: TestClient, register_node: Register, jobs_tick: Callable[[], Any]
) -> None:
    nodes = _cluster(register_node)
    api.post("/v1/jobs", json=_job("train"))
    jobs_tick()
    placed = _placed(api, nodes, "train")
    assert _ready(api, *placed[0]) == 200
    jobs_tick()
    assert api.get("/v1/jobs/train").json()["phase"] == "Pending"
    assert "1 of 2 members ready" in api.get("/v1/jobs/train/why").json()["summary"]
    assert not any(pod["barrier_released"] for _, pod in _placed(api, nodes, "train"))
    assert _ready(api, *placed[1]) == 200
    jobs_tick()
    job = api.get("/v1/jobs/train").json()
    assert job["phase"] == "Running" and job["barrier_released"]
    assert all(pod["barrier_released"] for _, pod in _placed(api, nodes, "train"))
    for reg, pod in placed:
        _report(api, reg, pod, "Running")
        _report(api, reg, pod, "Succeeded", exit_code=0)
    jobs_tick()
    assert api.get("/v1/jobs/train").json()["phase"] == "Succeeded"


def test_ready_with_a_stale_fencing_token_is_refused(
    api: TestClient, register_node: Register, jobs_tick: Callable[[], Any]
) -> None:
    nodes = _cluster(register_node)
    api.post("/v1/jobs", json=_job("train"))
    jobs_tick()
    reg, pod = _placed(api, nodes, "train")[0]
    api.post("/v1/agent/lease", headers=agent_headers(reg), json={"fencing_token": None})
    assert _ready(api, reg, pod) == 409
    assert not any(m["ready"] for m in _members(api, "train"))


def test_not_ready_in_time_stops_all_and_requeues_with_backoff(
    api: TestClient, register_node: Register, jobs_tick: Callable[[], Any],
    clock: ManualClock
) -> None:
    nodes = _cluster(register_node)
    api.post("/v1/jobs", json=_job("slow", ready_timeout=60))
    jobs_tick()
    placed = _placed(api, nodes, "slow")
    for reg, pod in placed:
        _report(api, reg, pod, "Pulling")
    _ready(api, *placed[0])
    clock.advance(59)
    jobs_tick()
    assert api.get("/v1/jobs/slow").json()["phase"] == "Pending"
    assert all(pod["desired_state"] == "running" for _, pod in _placed(api, nodes, "slow"))
    clock.advance(2)
    jobs_tick()
    job = api.get("/v1/jobs/slow").json()
    assert job["reason"] == "ReadyTimeout" and "1 of 2 members ready" in job["message"]
    stopping = _placed(api, nodes, "slow")
    assert all(pod["desired_state"] == "stopped" for _, pod in stopping)
    for reg, pod in stopping:
        _report(api, reg, pod, "Stopped")
    jobs_tick()
    job = api.get("/v1/jobs/slow").json()
    assert job["phase"] == "Pending" and job["restarts"] == 0
    assert all(m["phase"] == "Pending" and m["node"] is None for m in job["members"])
    jobs_tick()  # back-off (5 s): not placed yet
    assert all(m["node"] is None for m in _members(api, "slow"))
    assert "back-off" in api.get("/v1/jobs/slow/why").json()["summary"]
    clock.advance(5)
    jobs_tick()
    assert all(m["node"] for m in _members(api, "slow"))


def _fail_rank(api: TestClient, nodes: dict[str, dict[str, Any]], job: str,
               tick: Callable[[], Any], rank: int) -> None:
    """Start the gang, fail member ``rank``, let the others be stopped."""
    placed = _start(api, nodes, job, tick)
    for reg, pod in placed:
        _report(api, reg, pod, "Running")
    _report(api, *placed[rank], "Failed", exit_code=3)
    tick()
    for index, (reg, pod) in enumerate(placed):
        if index != rank:
            current = next(a for a in _assignments(api, reg) if a["pod_id"] == pod["pod_id"])
            assert current["desired_state"] == "stopped"
            _report(api, reg, pod, "Stopped")
    tick()


def test_a_failed_member_restarts_the_gang_until_max_restarts_then_fails(
    api: TestClient, register_node: Register, jobs_tick: Callable[[], Any],
    clock: ManualClock
) -> None:
    nodes = _cluster(register_node)
    api.post("/v1/jobs", json=_job("flaky", max_restarts=1))
    _fail_rank(api, nodes, "flaky", jobs_tick, rank=1)
    job = api.get("/v1/jobs/flaky").json()
    assert (job["phase"], job["restarts"], job["reason"]) == ("Pending", 1, "MemberFailed")
    assert all(m["phase"] == "Pending" for m in job["members"])
    clock.advance(5)
    _fail_rank(api, nodes, "flaky", jobs_tick, rank=0)
    job = api.get("/v1/jobs/flaky").json()
    assert (job["phase"], job["reason"]) == ("Failed", "MemberFailed")
    assert "member 0 (flaky-0) Failed" in job["message"]
    assert "exit code 3" in job["message"] and "max-restarts 1" in job["message"]


def test_a_lost_node_restarts_the_whole_gang(
    api: TestClient, register_node: Register, jobs_tick: Callable[[], Any],
    expire_leases: Callable[[], list[str]], clock: ManualClock
) -> None:
    nodes = _cluster(register_node)
    api.post("/v1/jobs", json=_job("train", max_restarts=2))
    placed = _start(api, nodes, "train", jobs_tick)
    lost_node = placed[0][0]
    clock.advance(6)
    for reg in nodes.values():
        if reg is not lost_node:
            api.post("/v1/agent/lease", headers=agent_headers(reg),
                     json={"fencing_token": reg["fencing_token"]})
    clock.advance(5)
    assert expire_leases() == [lost_node["name"]]
    jobs_tick()
    job = api.get("/v1/jobs/train").json()
    assert job["reason"] == "NodeLost"
    survivor_reg, survivor = placed[1]
    survivor = next(a for a in _assignments(api, survivor_reg)
                    if a["pod_id"] == survivor["pod_id"])
    assert survivor["desired_state"] == "stopped"
    _report(api, survivor_reg, survivor, "Stopped")
    jobs_tick()
    assert api.get("/v1/jobs/train").json()["restarts"] == 1
    clock.advance(5)
    jobs_tick()
    members = _members(api, "train")
    assert all(m["node"] and m["node"] != lost_node["name"] for m in members)


def test_stop_delete_and_member_pods_are_controlled_through_the_job(
    api: TestClient, register_node: Register, jobs_tick: Callable[[], Any]
) -> None:
    nodes = _cluster(register_node)
    api.post("/v1/jobs", json=_job("train"))
    api.post("/v1/jobs", json=_job("queued", nodes=3))
    placed = _start(api, nodes, "train", jobs_tick)
    assert api.post("/v1/pods/train-0/stop").status_code == 409
    assert api.delete("/v1/pods/train-1").status_code == 409
    stopped = api.post("/v1/jobs/queued/stop").json()
    assert stopped["phase"] == "Stopped"
    assert api.post("/v1/jobs/train/stop").json()["phase"] == "Running"
    for reg, pod in placed:
        _report(api, reg, pod, "Stopped")
    jobs_tick()
    assert api.get("/v1/jobs/train").json()["phase"] == "Stopped"
    assert api.post("/v1/jobs/train/stop").status_code == 409
    assert api.delete("/v1/jobs/train").status_code == 204
    assert api.get("/v1/jobs/train").status_code == 404
    assert [p["name"] for p in api.get("/v1/pods").json()] == [
        "queued-0", "queued-1", "queued-2"]


def test_logs_are_prefixed_by_rank(
    api: TestClient, register_node: Register, jobs_tick: Callable[[], Any]
) -> None:
    nodes = _cluster(register_node)
    api.post("/v1/jobs", json=_job("train"))
    for rank, (reg, pod) in enumerate(_start(api, nodes, "train", jobs_tick)):
        api.post(f"/v1/agent/pods/{pod['pod_id']}/logs", headers=agent_headers(reg),
                 json={"fencing_token": reg["fencing_token"], "attempt": pod["attempt"],
                       "offset": 0, "data": f"hello from {rank}\nbye\n"})
    text = api.get("/v1/jobs/train/logs").json()["text"]
    assert text == "[0] hello from 0\n[0] bye\n[1] hello from 1\n[1] bye\n"


def _ship(api: TestClient, reg: dict[str, Any], pod: dict[str, Any], offset: int,
          data: str) -> int:
    """An agent's log chunk of the member's attempt; returns the next offset."""
    response = api.post(f"/v1/agent/pods/{pod['pod_id']}/logs", headers=agent_headers(reg),
                        json={"fencing_token": reg["fencing_token"], "attempt": pod["attempt"],
                              "offset": offset, "data": data})
    assert response.status_code == 200, response.text
    return int(response.json()["next_offset"])


def _logs(api: TestClient, job: str, **params: Any) -> dict[str, Any]:
    response = api.get(f"/v1/jobs/{job}/logs", params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_following_logs_hands_out_new_whole_lines_until_the_job_ends(
    api: TestClient, register_node: Register, jobs_tick: Callable[[], Any]
) -> None:
    nodes = _cluster(register_node)
    api.post("/v1/jobs", json=_job("train"))
    placed = _start(api, nodes, "train", jobs_tick)
    (reg0, pod0), (reg1, pod1) = placed
    first = _logs(api, "train", offsets="")
    assert (first["text"], first["offsets"], first["finished"]) == ("", "0:1:0,1:1:0", False)
    end0 = _ship(api, reg0, pod0, 0, "héllo\nstep 1")
    _ship(api, reg1, pod1, 0, "ready\n")
    assert _logs(api, "train")["text"] == "[0] héllo\n[0] step 1\n[1] ready\n"  # one-shot
    page = _logs(api, "train", offsets=first["offsets"])
    assert page["text"] == "[0] héllo\n[1] ready\n"  # "step 1" is not a whole line yet
    assert page["offsets"] == "0:1:7,1:1:6"  # bytes: é is two
    assert page["members"] == [
        {"rank": 0, "attempt": 1, "next_offset": 7, "finished": False},
        {"rank": 1, "attempt": 1, "next_offset": 6, "finished": False}]
    assert _logs(api, "train", offsets=first["offsets"]) == page  # the cursor is the state
    _ship(api, reg0, pod0, end0, " done\nstep 2")
    page = _logs(api, "train", offsets=page["offsets"])
    assert (page["text"], page["finished"]) == ("[0] step 1 done\n", False)
    for reg, pod in placed:
        _report(api, reg, pod, "Running")
        _report(api, reg, pod, "Succeeded", exit_code=0)
    page = _logs(api, "train", offsets=page["offsets"])
    assert (page["text"], page["finished"]) == ("[0] step 2\n", False)  # rank 0 ended
    assert [m["finished"] for m in page["members"]] == [True, True]
    jobs_tick()
    page = _logs(api, "train", offsets=page["offsets"])
    assert (page["text"], page["finished"]) == ("", True)


def test_following_logs_goes_on_with_the_next_attempt_after_a_gang_restart(
    api: TestClient, register_node: Register, jobs_tick: Callable[[], Any],
    clock: ManualClock
) -> None:
    nodes = _cluster(register_node)
    api.post("/v1/jobs", json=_job("flaky", max_restarts=1))
    placed = _start(api, nodes, "flaky", jobs_tick)
    for reg, pod in placed:
        _report(api, reg, pod, "Running")
    (reg0, pod0), (reg1, pod1) = placed
    end = _ship(api, reg0, pod0, 0, "epoch 1\nsaving")
    page = _logs(api, "flaky", offsets="")
    assert page["text"] == "[0] epoch 1\n"
    _ship(api, reg0, pod0, end, " checkpoint")  # attempt 1 ends without a newline
    _report(api, reg1, pod1, "Failed", exit_code=3)
    jobs_tick()
    _report(api, reg0, pod0, "Stopped")
    jobs_tick()
    assert api.get("/v1/jobs/flaky").json()["restarts"] == 1
    clock.advance(5)
    (reg0, pod0), _ = _start(api, nodes, "flaky", jobs_tick)
    assert pod0["attempt"] == 2
    _ship(api, reg0, pod0, 0, "epoch 1 again\n")
    page = _logs(api, "flaky", offsets=page["offsets"])
    assert page["text"] == "[0] saving checkpoint\n[0] epoch 1 again\n"
    assert page["offsets"] == "0:2:14,1:2:0"
    assert _logs(api, "flaky")["text"] == "[0] epoch 1 again\n"  # one-shot: current attempt


def test_logs_tail_and_bad_offsets(
    api: TestClient, register_node: Register, jobs_tick: Callable[[], Any]
) -> None:
    nodes = _cluster(register_node)
    api.post("/v1/jobs", json=_job("train"))
    for rank, (reg, pod) in enumerate(_start(api, nodes, "train", jobs_tick)):
        _ship(api, reg, pod, 0, f"a{rank}\nb{rank}\nc{rank}")
    assert _logs(api, "train", tail=2)["text"] == "[0] b0\n[0] c0\n[1] b1\n[1] c1\n"
    page = _logs(api, "train", offsets="", tail=1)
    assert (page["text"], page["offsets"]) == ("[0] b0\n[1] b1\n", "0:1:6,1:1:6")
    # a member with a position continues from it; one left out starts afresh, with tail
    assert _logs(api, "train", offsets="0:1:0", tail=1)["text"] == "[0] a0\n[0] b0\n[1] b1\n"
    for value, says in [("x", "offsets: 'x' is not RANK:ATTEMPT:OFFSET"),
                        ("0:1:0,0:1:3", "rank 0 is given twice"),
                        ("2:1:0", "job 'train' has no rank 2"),
                        ("0:2:0", "rank 0 is on attempt 1; it has had no attempt 2")]:
        response = api.get("/v1/jobs/train/logs", params={"offsets": value})
        assert response.status_code == 422, value
        assert response.json()["field"] == "offsets" and says in response.json()["detail"]
    response = api.get("/v1/jobs/train/logs", params={"tail": -1})
    assert response.status_code == 422 and response.json()["field"] == "tail"


def test_job_events_merge_the_members_events_in_time_order(
    api: TestClient, app_client: TestClient, register_node: Register,
    jobs_tick: Callable[[], Any], clock: ManualClock
) -> None:
    nodes = _cluster(register_node)
    api.post("/v1/jobs", json=_job("train"))
    assert api.get("/v1/jobs/train/events").json() == []  # nothing has happened yet
    jobs_tick()
    placed = _placed(api, nodes, "train")
    for reg, pod in reversed(placed):  # rank 1 is ready first
        clock.advance(1)
        assert _ready(api, reg, pod) == 200
    jobs_tick()
    for reg, pod in placed:
        _report(api, reg, pod, "Running")
    clock.advance(1)
    _report(api, *placed[1], "Failed", exit_code=3)
    jobs_tick()  # the gang stops its other member
    events = api.get("/v1/jobs/train/events").json()
    assert [(e["rank"], e["pod"], e["reason"], e["to_phase"]) for e in events] == [
        (0, "train-0", "Scheduled", "Scheduled"), (1, "train-1", "Scheduled", "Scheduled"),
        (1, "train-1", "Ready", None), (0, "train-0", "Ready", None),
        (0, "train-0", "Started", "Running"), (1, "train-1", "Started", "Running"),
        (1, "train-1", "Error (exit code 3)", "Failed"), (0, "train-0", "StopRequested", None)]
    assert [e["time"] for e in events] == sorted(e["time"] for e in events)
    assert events[0]["from_phase"] == "Pending" and "bound to" in events[0]["message"]
    team = api.post("/v1/projects", json={"name": "team-b"}).json()["key"]["key"]
    other = {"Authorization": f"Bearer {team}"}
    for path in ("/v1/jobs/train/events", "/v1/jobs/train/logs"):
        response = app_client.get(path, headers=other)
        assert response.status_code == 404 and response.json()["detail"] == (
            "job 'train' not found")
    assert api.get("/v1/jobs/nope/events").status_code == 404


@pytest.mark.parametrize(("fields", "field"), [
    ({"nodes": 0}, "nodes"),
    ({"gpus_per_node": -1}, "gpus_per_node"),
    ({"topology": "same-room"}, "topology"),
    ({"priority_class": "urgent"}, "priority_class"),
    ({"max_restarts": -1}, "max_restarts"),
    ({"ready_timeout": 0}, "ready_timeout"),
    ({"name": "x" * 62, "nodes": 10}, "name"),
    ({"name": "Bad_Name"}, "name"),
])
def test_bad_input_is_a_422_naming_the_field(
    api: TestClient, fields: dict[str, Any], field: str
) -> None:
    response = api.post("/v1/jobs", json={**_job("ok"), **fields})
    assert response.status_code == 422, response.text
    assert response.json()["field"] == field
    assert api.get("/v1/jobs").json() == [] and api.get("/v1/pods").json() == []


def test_duplicate_names_and_priority_classes(api: TestClient) -> None:
    api.post("/v1/pods", json={"name": "taken-1", "image": "busybox"})
    clash = api.post("/v1/jobs", json=_job("taken"))
    assert clash.status_code == 422 and "taken-1" in clash.json()["detail"]
    created = api.post("/v1/jobs", json=_job("spotty", priority_class="spot")).json()
    assert created["priority_class"] == "spot"
    again = api.post("/v1/jobs", json=_job("spotty"))
    assert again.status_code == 422 and again.json()["field"] == "name"
