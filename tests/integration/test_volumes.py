"""Volume disks and network volumes through the REST API (both databases): validation,
placement on the volume's node, `pod why`, zero-GPU starts, the agent's lists."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpucloud.core.settings import Settings
from tests.integration.conftest import agent_headers

POD = {"name": "dev", "image": "busybox", "command": ["sleep", "60"], "gpus": 1,
       "volume_size": "20Gi"}
Register = Callable[..., dict[str, Any]]


def _status(api: TestClient, reg: dict[str, Any], pod_id: str, phase: str) -> None:
    response = api.post(f"/v1/agent/pods/{pod_id}/status", headers=agent_headers(reg),
                        json={"fencing_token": reg["fencing_token"], "phase": phase})
    assert response.status_code == 200, response.text


def _assignments(api: TestClient, reg: dict[str, Any]) -> dict[str, Any]:
    response = api.get("/v1/agent/assignments", headers=agent_headers(reg))
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _stopped(api: TestClient, reg: dict[str, Any], name: str) -> dict[str, Any]:
    """Run the pod to Running on its node, then stop it as its agent would."""
    pod: dict[str, Any] = api.get(f"/v1/pods/{name}").json()
    _status(api, reg, pod["id"], "Running")
    api.post(f"/v1/pods/{name}/stop")
    _status(api, reg, pod["id"], "Stopped")
    stopped: dict[str, Any] = api.get(f"/v1/pods/{name}").json()
    assert stopped["phase"] == "Stopped"
    return stopped


@pytest.mark.parametrize(("change", "field"), [
    ({"volume_path": "workspace"}, "volume_path"),
    ({"volume_path": "/"}, "volume_path"),
    ({"volume_path": "/proc"}, "volume_path"),
    ({"volume_path": "/sys/fs"}, "volume_path"),
    ({"volume_path": "/dev"}, "volume_path"),
    ({"volume_path": "/a/../proc"}, "volume_path"),
    ({"volume_size": "lots"}, "volume_size"),
    ({"volume_size": "10Ki"}, "volume_size"),
    ({"container_disk": "-1Gi"}, "container_disk"),
    ({"network_volumes": ["data:relative"]}, "network_volumes"),
    ({"network_volumes": ["data:/proc/x"]}, "network_volumes"),
    ({"network_volumes": ["Bad_Name"]}, "network_volumes"),
    ({"network_volumes": ["nope"]}, "network_volumes"),
])
def test_bad_volume_input_is_422_naming_the_field_and_writes_nothing(
    api: TestClient, change: dict[str, Any], field: str
) -> None:
    response = api.post("/v1/pods", json={**POD, **change})
    assert response.status_code == 422, response.text
    assert response.json()["field"] == field
    assert api.get("/v1/pods").json() == []


def test_volume_routes_create_list_get_delete(api: TestClient, settings: Settings) -> None:
    created = api.post("/v1/volumes", json={"name": "data", "size": "100Gi", "zone": "eu-1"})
    assert created.status_code == 201, created.text
    volume = created.json()
    assert (volume["size_bytes"], volume["size"], volume["zone"]) == (100 * 1024**3, "100Gi",
                                                                      "eu-1")
    directory = settings.home / "volumes" / volume["id"]
    assert directory.is_dir()
    assert api.get("/v1/volumes/data").json() == volume
    assert [v["name"] for v in api.get("/v1/volumes").json()] == ["data"]
    again = api.post("/v1/volumes", json={"name": "data", "size": "1Gi"})
    assert again.status_code == 422 and again.json()["field"] == "name"
    assert api.delete("/v1/volumes/data").status_code == 204
    assert api.get("/v1/volumes/data").status_code == 404
    assert not directory.exists()


@pytest.mark.parametrize(("body", "field"), [
    ({"name": "Bad_Name", "size": "1Gi"}, "name"),
    ({"name": "ok", "size": "huge"}, "size"),
    ({"name": "ok", "size": "2Pi"}, "size"),
    ({"name": "ok"}, "size"),
    ({"name": "ok", "size": "1Gi", "colour": "red"}, "colour"),
])
def test_bad_volume_create_is_422_and_writes_nothing(
    api: TestClient, settings: Settings, body: dict[str, Any], field: str
) -> None:
    response = api.post("/v1/volumes", json=body)
    assert response.status_code == 422 and response.json()["field"] == field, response.text
    assert api.get("/v1/volumes").json() == []
    root = settings.home / "volumes"
    assert not root.exists() or list(root.iterdir()) == []


def test_volumes_belong_to_their_project(api: TestClient) -> None:
    api.post("/v1/volumes", json={"name": "data", "size": "1Gi"})
    key = api.post("/v1/projects", json={"name": "team-b"}).json()["key"]["key"]
    other = {"Authorization": f"Bearer {key}"}
    assert api.get("/v1/volumes", headers=other).json() == []
    assert api.get("/v1/volumes/data", headers=other).status_code == 404
    pod = api.post("/v1/pods", headers=other,
                   json={**POD, "name": "b", "network_volumes": ["data"]})
    assert pod.status_code == 422 and pod.json()["field"] == "network_volumes"


def test_delete_is_refused_while_a_live_pod_mounts_it(
    api: TestClient, register_node: Register, schedule: Callable[[], Any]
) -> None:
    reg = register_node("n1", volume_mode="hostpath")
    api.post("/v1/volumes", json={"name": "data", "size": "1Gi"})
    created = api.post("/v1/pods", json={**POD, "network_volumes": ["data:/data"]})
    assert created.status_code == 201, created.text
    assert created.json()["network_volumes"] == ["data:/data"]
    refused = api.delete("/v1/volumes/data")
    assert refused.status_code == 409 and "dev" in refused.json()["detail"]
    assert api.get("/v1/volumes/data").json()["mounted_by"] == ["dev"]
    schedule()
    mounts = _assignments(api, reg)["pods"][0]["network_volumes"]
    volume = api.get("/v1/volumes/data").json()
    assert mounts == [{"name": "data", "volume_id": volume["id"], "path": "/data",
                       "mode": "hostpath", "source": mounts[0]["source"],
                       "size_bytes": 1024**3}]
    assert Path(mounts[0]["source"]).is_dir()
    _stopped(api, reg, "dev")
    assert api.delete("/v1/volumes/data").status_code == 204
    restart = api.post("/v1/pods/dev/start")
    assert restart.status_code == 422 and restart.json()["field"] == "network_volumes"


def test_a_stopped_pod_restarts_only_on_its_volume_node(
    api: TestClient, register_node: Register, schedule: Callable[[], Any]
) -> None:
    first = register_node("n1", gpus=[{"uuid": "GPU-a", "model": "H100-80GB",
                                       "memory_mib": 81559}])
    pod = api.post("/v1/pods", json=POD).json()
    assert pod["volume_path"] == "/workspace" and pod["volume_size"] == 20 * 1024**3
    schedule()
    bound = api.get("/v1/pods/dev").json()
    assert (bound["node"], bound["volume_node"]) == ("n1", "n1")
    assignment = _assignments(api, first)
    assert assignment["volume_pods"] == [pod["id"]]
    assert (assignment["pods"][0]["volume_bytes"],
            assignment["pods"][0]["volume_path"]) == (20 * 1024**3, "/workspace")
    _stopped(api, first, "dev")
    assert _assignments(api, first)["volume_pods"] == [pod["id"]]
    # n1's only GPU is taken by another pod; a second node has room, but not the volume
    api.post("/v1/pods", json={"name": "other", "image": "busybox", "gpus": 1})
    schedule()
    register_node("n2")
    assert api.post("/v1/pods/dev/start").status_code == 200
    schedule()
    waiting = api.get("/v1/pods/dev").json()
    assert waiting["phase"] == "Pending" and waiting["node"] is None
    why = api.get("/v1/pods/dev/why").json()
    assert why["summary"].startswith("its volume is on node n1; ")
    assert why["reasons"] == {"its volume is on node n1": 1, "not enough free GPUs": 1}


def test_zero_gpu_start_reaches_the_volume_without_gpus(
    api: TestClient, register_node: Register, schedule: Callable[[], Any]
) -> None:
    reg = register_node("n1", gpus=[{"uuid": "GPU-a", "model": "H100-80GB",
                                     "memory_mib": 81559}])
    api.post("/v1/pods", json=POD)
    schedule()
    _stopped(api, reg, "dev")
    api.post("/v1/pods", json={"name": "other", "image": "busybox", "gpus": 1})
    schedule()
    bad = api.post("/v1/pods/dev/start", params={"gpus": 1.5})
    assert bad.status_code == 422 and bad.json()["field"] == "gpus"
    started = api.post("/v1/pods/dev/start", params={"gpus": 0})
    assert started.status_code == 200 and started.json()["gpus"] == 0
    schedule()
    pod = api.get("/v1/pods/dev").json()
    assert (pod["phase"], pod["node"], pod["gpu_uuids"]) == ("Scheduled", "n1", [])


def test_a_lost_volume_node_is_named_by_why(
    api: TestClient, register_node: Register, schedule: Callable[[], Any],
    expire_leases: Callable[[], list[str]], clock: Any,
) -> None:
    reg = register_node("n1")
    api.post("/v1/pods", json=POD)
    schedule()
    _stopped(api, reg, "dev")
    clock.advance(3600)
    expire_leases()
    register_node("n2")
    api.post("/v1/pods/dev/start")
    schedule()
    why = api.get("/v1/pods/dev/why").json()["summary"]
    assert why.startswith("its volume is on node n1, which is Lost: the pod starts there")


def test_deleting_the_pod_drops_its_volume_from_the_node_list(
    api: TestClient, register_node: Register, schedule: Callable[[], Any]
) -> None:
    reg = register_node("n1")
    pod = api.post("/v1/pods", json=POD).json()
    api.post("/v1/pods", json={**POD, "name": "plain", "volume_size": None})
    schedule()
    assert _assignments(api, reg)["volume_pods"] == [pod["id"]]
    assert api.delete("/v1/pods/dev").status_code == 204
    assert _assignments(api, reg)["volume_pods"] == []
