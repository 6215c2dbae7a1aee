"""Pods through the REST API: create, read back, validation, tenancy, lifecycle."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

POD = {"name": "train", "image": "ghcr.io/acme/trainer:1.2", "command": ["python", "t.py"],
       "gpus": 2, "gpu_type": "h100", "cpu": 8, "memory": "64Gi", "env": {"EPOCHS": "3"},
       "ports": ["8888/http"], "restart": "on-failure"}


def _count_pods(api: TestClient) -> int:
    return len(api.get("/v1/pods").json())


def test_create_returns_the_request_and_pending_phase(api: TestClient) -> None:
    response = api.post("/v1/pods", json=POD)
    assert response.status_code == 201, response.text
    pod = response.json()
    assert pod["phase"] == "Pending" and pod["node"] is None and pod["reason"] == "Created"
    assert pod["gpu_type"] == "H100-80GB"
    assert pod["memory"] == "64Gi" and pod["cpu"] == 8 and pod["gpus"] == 2
    assert pod["env"] == {"EPOCHS": "3"} and pod["ports"] == ["8888/http"]
    assert pod["restart"] == "on-failure" and pod["command"] == ["python", "t.py"]
    by_name = api.get("/v1/pods/train").json()
    by_id = api.get(f"/v1/pods/{pod['id']}").json()
    assert by_name == by_id
    events = api.get("/v1/pods/train/events").json()
    assert [(e["to_phase"], e["reason"]) for e in events] == [("Pending", "Created")]


@pytest.mark.parametrize(("change", "field"), [
    ({"gpus": -1}, "gpus"),
    ({"gpus": 100000}, "gpus"),
    ({"gpus": 1.5}, "gpus"),
    ({"cpu": -2}, "cpu"),
    ({"cpu": "lots"}, "cpu"),
    ({"memory": "16Qi"}, "memory"),
    ({"memory": "900Pi"}, "memory"),
    ({"gpu_type": "TPU-v9"}, "gpu_type"),
    ({"gpu_type": "<script>"}, "gpu_type"),
    ({"image": "Upper:tag"}, "image"),
    ({"image": "repo:bad tag"}, "image"),
    ({"image": ""}, "image"),
    ({"name": "x" * 64}, "name"),
    ({"name": "Not_DNS"}, "name"),
    ({"name": "-lead"}, "name"),
    ({"env": {"1BAD": "x"}}, "env"),
    ({"ports": ["99999"]}, "ports"),
    ({"restart": "sometimes"}, "restart"),
    ({"gpu_count": 2}, "gpu_count"),
])
def test_bad_input_is_422_naming_the_field_and_writes_nothing(
    api: TestClient, change: dict[str, Any], field: str
) -> None:
    response = api.post("/v1/pods", json={**POD, **change})
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["field"] == field
    assert field in body["detail"] and "\n" not in body["detail"]
    assert _count_pods(api) == 0


def test_missing_required_field_is_named(api: TestClient) -> None:
    response = api.post("/v1/pods", json={"name": "a"})
    assert response.status_code == 422 and response.json()["field"] == "image"


def test_duplicate_name_in_project_is_422_and_other_projects_may_reuse_it(
    api: TestClient
) -> None:
    assert api.post("/v1/pods", json=POD).status_code == 201
    duplicate = api.post("/v1/pods", json=POD)
    assert duplicate.status_code == 422 and duplicate.json()["field"] == "name"
    assert _count_pods(api) == 1
    key = api.post("/v1/projects", json={"name": "team-b"}).json()["key"]["key"]
    other = api.post("/v1/pods", json=POD, headers={"Authorization": f"Bearer {key}"})
    assert other.status_code == 201


def test_gpu_model_known_only_from_a_registered_node_is_accepted(
    api: TestClient, register_node: Any
) -> None:
    assert api.post("/v1/pods", json={**POD, "gpu_type": "MI300X"}).status_code == 422
    register_node("amd-1", gpus=[{"uuid": "GPU-amd-0", "model": "MI300X",
                                  "memory_mib": 196608}])
    assert api.post("/v1/pods", json={**POD, "gpu_type": "MI300X"}).status_code == 201


def test_keys_and_tenancy(app_client: TestClient, api: TestClient) -> None:
    assert app_client.get("/v1/pods", headers={"Authorization": ""}).status_code == 401
    assert app_client.get("/v1/pods",
                          headers={"Authorization": "Bearer gpc_wrong"}).status_code == 401
    created = api.post("/v1/projects", json={"name": "team-a"})
    assert created.status_code == 201
    team = {"Authorization": f"Bearer {created.json()['key']['key']}"}
    pod = api.post("/v1/pods", json=POD).json()
    assert app_client.get(f"/v1/pods/{pod['id']}", headers=team).status_code == 404
    assert app_client.get("/v1/pods/train", headers=team).status_code == 404
    assert app_client.post(f"/v1/pods/{pod['id']}/stop", headers=team).status_code == 404
    assert app_client.post("/v1/projects", json={"name": "x"}, headers=team).status_code == 403
    assert app_client.post("/v1/nodes/join-tokens", headers=team).status_code == 403
    assert app_client.get("/v1/pods", headers=team).json() == []
    assert api.post("/v1/projects", json={"name": "team-a"}).status_code == 409


def test_key_create_list_revoke(app_client: TestClient, api: TestClient) -> None:
    team = api.post("/v1/projects", json={"name": "team-c"}).json()["key"]["key"]
    headers = {"Authorization": f"Bearer {team}"}
    second = app_client.post("/v1/keys", json={"name": "ci"}, headers=headers).json()
    keys = app_client.get("/v1/keys", headers=headers).json()
    assert sorted(k["name"] for k in keys) == ["ci", "default"]
    assert all("key" not in k for k in keys)
    revoked = app_client.post("/v1/keys/ci/revoke", headers=headers)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    dead = {"Authorization": f"Bearer {second['key']}"}
    assert app_client.get("/v1/pods", headers=dead).status_code == 401
    assert app_client.get("/v1/pods", headers=headers).status_code == 200


def test_stop_start_delete_a_pending_pod(api: TestClient) -> None:
    api.post("/v1/pods", json=POD)
    stopped = api.post("/v1/pods/train/stop").json()
    assert stopped["phase"] == "Stopped"
    assert api.post("/v1/pods/train/stop").status_code == 409
    assert api.post("/v1/pods/train/start").json()["phase"] == "Pending"
    assert api.post("/v1/pods/train/start").status_code == 409
    assert api.delete("/v1/pods/train").status_code == 204
    assert api.get("/v1/pods/train").status_code == 404
    assert api.post("/v1/pods", json=POD).status_code == 201
    phases = [e["to_phase"] for e in api.get("/v1/pods/train/events").json()]
    assert phases == ["Pending"]


def test_openapi_and_health(app_client: TestClient) -> None:
    assert app_client.get("/healthz").json()["status"] == "ok"
    assert app_client.get("/docs").status_code == 200
    paths = app_client.get("/openapi.json").json()["paths"]
    assert "/v1/pods" in paths and "/v1/agent/register" in paths
