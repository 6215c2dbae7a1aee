"""Templates and registry credentials through the REST API (both databases): the one
container spec stored and shown the same way for pods, jobs and templates; a pod from a
template with overrides; the credentials reaching only the assignment of a pod whose image
is on their registry; bad input refused with the field named and nothing written."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.integration.conftest import agent_headers

TEMPLATE = {"name": "jupyter", "image": "127.0.0.1:5000/lab/jupyter:3",
            "command": ["jupyter", "lab"], "gpus": 1, "env": {"A": "1", "B": "2"},
            "ports": ["8888/http", "22/tcp"], "volume_size": "20Gi",
            "volume_path": "/workspace", "container_disk": "10Gi",
            "entrypoint": ["/bin/sh", "-c"], "registry_auth": "lab",
            "network_volumes": ["datasets:/data"]}
AUTH = {"name": "lab", "username": "alice", "password": "s3cret-pass",
        "registry": "127.0.0.1:5000"}


@pytest.fixture
def template(api: TestClient) -> dict[str, Any]:
    assert api.post("/v1/registry-auths", json=AUTH).status_code == 201
    assert api.post("/v1/volumes", json={"name": "datasets", "size": "1Gi"}).status_code == 201
    response = api.post("/v1/templates", json=TEMPLATE)
    assert response.status_code == 201, response.text
    return dict(response.json())


def test_template_round_trip(api: TestClient, template: dict[str, Any]) -> None:
    assert template["volume_size"] == 20 * 1024**3 and template["container_disk"] == 10 * 1024**3
    assert template["ports"] == ["8888/http", "22/tcp"] and template["gpus"] == 1
    assert template["entrypoint"] == ["/bin/sh", "-c"]
    assert template["network_volumes"] == ["datasets:/data"]
    assert template["registry_auth"] == "lab" and template["memory"] == "1Gi"
    assert api.get("/v1/templates/jupyter").json() == template
    assert api.get(f"/v1/templates/{template['id']}").json() == template
    assert [t["name"] for t in api.get("/v1/templates").json()] == ["jupyter"]
    again = api.post("/v1/templates", json=TEMPLATE)
    assert again.status_code == 422 and again.json()["field"] == "name"
    assert api.delete("/v1/templates/jupyter").status_code == 204
    assert api.get("/v1/templates/jupyter").status_code == 404
    assert api.get("/v1/templates").json() == []


def test_pod_from_template_takes_its_spec_and_given_overrides(
        api: TestClient, template: dict[str, Any]) -> None:
    plain = api.post("/v1/pods", json={"name": "lab-1", "template": "jupyter"})
    assert plain.status_code == 201, plain.text
    pod = plain.json()
    for field in ("image", "command", "gpus", "env", "ports", "volume_size", "volume_path",
                  "container_disk", "entrypoint", "registry_auth", "network_volumes",
                  "memory", "cpu"):
        assert pod[field] == template[field], field
    assert pod["template"] == "jupyter"
    over = api.post("/v1/pods", json={
        "name": "lab-2", "template": "jupyter", "gpus": 0, "env": {"C": "3"},
        "entrypoint": [], "command": ["sleep", "1"], "memory": "2Gi"}).json()
    assert over["gpus"] == 0 and over["env"] == {"C": "3"} and over["memory"] == "2Gi"
    assert over["entrypoint"] == [] and over["command"] == ["sleep", "1"]
    assert over["image"] == TEMPLATE["image"] and over["ports"] == template["ports"]
    assert over["volume_size"] == template["volume_size"]
    # the pod copied the template: deleting it leaves the pod as it was
    api.delete("/v1/templates/jupyter")
    assert api.get("/v1/pods/lab-2").json()["volume_size"] == template["volume_size"]


def test_pod_spec_fields_persist_without_template(api: TestClient) -> None:
    response = api.post("/v1/pods", json={
        "name": "p", "image": "busybox", "entrypoint": ["/bin/echo"], "volume_size": "1Gi",
        "volume_path": "/work", "container_disk": "2Gi"})
    assert response.status_code == 201, response.text
    pod = api.get("/v1/pods/p").json()
    assert pod["entrypoint"] == ["/bin/echo"] and pod["volume_size"] == 1024**3
    assert pod["volume_path"] == "/work" and pod["container_disk"] == 2 * 1024**3
    assert pod["template"] is None and pod["registry_auth"] is None


def test_job_members_carry_the_spec(api: TestClient) -> None:
    assert api.post("/v1/registry-auths", json=AUTH).status_code == 201
    response = api.post("/v1/jobs", json={
        "name": "train", "image": "127.0.0.1:5000/lab/jupyter:3", "nodes": 2,
        "entrypoint": ["torchrun"], "registry_auth": "lab", "container_disk": "5Gi"})
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["entrypoint"] == ["torchrun"] and job["registry_auth"] == "lab"
    assert job["container_disk"] == 5 * 1024**3
    for member in job["members"]:
        pod = api.get(f"/v1/pods/{member['pod_id']}").json()
        assert pod["entrypoint"] == ["torchrun"] and pod["registry_auth"] == "lab"
        assert pod["container_disk"] == 5 * 1024**3


def test_registry_auth_password_is_never_returned(api: TestClient) -> None:
    added = api.post("/v1/registry-auths", json=AUTH)
    assert added.status_code == 201
    listed = api.get("/v1/registry-auths")
    for body in (added.text, listed.text):
        assert AUTH["password"] not in body
    assert listed.json()[0]["username"] == "alice"
    assert listed.json()[0]["registry"] == "127.0.0.1:5000"
    again = api.post("/v1/registry-auths", json=AUTH)
    assert again.status_code == 422 and again.json()["field"] == "name"
    assert api.delete("/v1/registry-auths/lab").status_code == 204
    assert api.get("/v1/registry-auths").json() == []
    assert api.delete("/v1/registry-auths/lab").status_code == 404


def _assignment(api: TestClient, reg: dict[str, Any], pod_id: str) -> dict[str, Any]:
    body = api.get("/v1/agent/assignments", headers=agent_headers(reg)).json()
    return next(p for p in body["pods"] if p["pod_id"] == pod_id)


def test_assignment_carries_entrypoint_and_credentials_for_their_registry_only(
        api: TestClient, template: dict[str, Any],
        register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]) -> None:
    reg = register_node("gpu-1")
    on_registry = api.post("/v1/pods", json={"name": "a", "template": "jupyter",
                                             "network_volumes": []}).json()
    elsewhere = api.post("/v1/pods", json={"name": "b", "template": "jupyter",
                                           "network_volumes": [],
                                           "image": "ghcr.io/acme/x:1"}).json()
    schedule()
    first = _assignment(api, reg, on_registry["id"])
    assert first["entrypoint"] == ["/bin/sh", "-c"]
    assert (first["registry_username"], first["registry_password"]) == ("alice", "s3cret-pass")
    second = _assignment(api, reg, elsewhere["id"])
    assert second["registry_username"] is None and second["registry_password"] is None


@pytest.mark.parametrize(("body", "field"), [
    ({"name": "x"}, "image"),
    ({"name": "x", "template": "nope"}, "template"),
    ({"name": "x", "image": "busybox", "registry_auth": "nope"}, "registry_auth"),
    ({"name": "x", "image": "busybox", "ports": ["0"]}, "ports"),
    ({"name": "x", "image": "busybox", "ports": ["65536/tcp"]}, "ports"),
    ({"name": "x", "image": "busybox", "ports": ["8888/http", "8888"]}, "ports"),
    ({"name": "x", "image": "busybox", "entrypoint": "sh"}, "entrypoint"),
    ({"name": "x", "image": "busybox", "volume_path": "/proc/x"}, "volume_path"),
    ({"name": "x", "image": "busybox", "colour": "red"}, "colour"),
])
def test_bad_pod_requests_name_the_field_and_write_nothing(
        api: TestClient, body: dict[str, Any], field: str) -> None:
    response = api.post("/v1/pods", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["field"] == field
    assert api.get("/v1/pods").json() == []


@pytest.mark.parametrize(("change", "field"), [
    ({"image": None}, "image"),
    ({"registry_auth": "nope"}, "registry_auth"),
    ({"ports": ["22/tcp", "22"]}, "ports"),
    ({"ports": ["70000"]}, "ports"),
    ({"gpus": 1.5}, "gpus"),
    ({"restart": "always"}, "restart"),
    ({"name": "Bad_Name"}, "name"),
])
def test_bad_templates_name_the_field_and_write_nothing(
        api: TestClient, change: dict[str, Any], field: str) -> None:
    body = {**TEMPLATE, "registry_auth": None, **change}
    response = api.post("/v1/templates", json={k: v for k, v in body.items() if v is not None})
    assert response.status_code == 422, response.text
    assert response.json()["field"] == field
    assert api.get("/v1/templates").json() == []


def test_other_projects_cannot_see_or_use_templates_and_credentials(
        api: TestClient, template: dict[str, Any]) -> None:
    key = api.post("/v1/projects", json={"name": "team-b"}).json()["key"]["key"]
    other = {"Authorization": f"Bearer {key}"}
    assert api.get("/v1/templates", headers=other).json() == []
    assert api.get("/v1/templates/jupyter", headers=other).status_code == 404
    assert api.get("/v1/registry-auths", headers=other).json() == []
    refused = api.post("/v1/pods", json={"name": "x", "template": "jupyter"}, headers=other)
    assert refused.status_code == 422 and refused.json()["field"] == "template"
    refused = api.post("/v1/pods", json={"name": "x", "image": "busybox",
                                         "registry_auth": "lab"}, headers=other)
    assert refused.status_code == 422 and refused.json()["field"] == "registry_auth"
    assert api.delete("/v1/templates/jupyter", headers=other).status_code == 404
