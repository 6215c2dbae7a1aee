"""RunPod's REST v1 and v2 under /runpod: the request shapes runpodctl (internal/api/pods.go,
cmd/pod/create.go) and RunPod's v2 OpenAPI send, against the app with its own services."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import asyncssh
from fastapi.testclient import TestClient

from tests.conftest import ADMIN_KEY

V1 = "/runpod/v1"
V2 = "/runpod/v2"
IMAGE = "docker.io/library/busybox:latest"


def _runpodctl_cpu_pod(name: str) -> dict[str, Any]:
    """``runpodctl pod create --compute-type CPU`` (createPodREST): omitempty fields left
    out, GpuCount 0 omitted, ports split on commas, env from --env JSON."""
    return {"name": name, "imageName": IMAGE, "computeType": "CPU", "containerDiskInGb": 5,
            "ports": ["8888/http", "22/tcp"], "env": {"HELLO": "world"},
            "dockerArgs": "sh -c 'echo \"hi there\"; sleep 5'"}


def test_auth_is_bearer_bare_or_query_and_errors_are_runpods(app_client: TestClient) -> None:
    for headers, params in (({"Authorization": f"Bearer {ADMIN_KEY}"}, {}),
                            ({"Authorization": ADMIN_KEY}, {}), ({}, {"api_key": ADMIN_KEY})):
        assert app_client.get(f"{V1}/pods", headers=headers, params=params).json() == []
    v2 = app_client.get(f"{V2}/pods", headers={"Authorization": "Bearer gpc_wrong"})
    assert v2.status_code == 401 and v2.headers["content-type"] == "application/problem+json"
    assert v2.json()["status"] == 401 and v2.json()["title"] == "Unauthorized"
    v1 = app_client.get(f"{V1}/pods")
    assert v1.status_code == 401 and set(v1.json()) == {"error", "status"}


def test_runpodctl_rest_v1_lifecycle(api: TestClient) -> None:
    created = api.post(f"{V1}/pods", json=_runpodctl_cpu_pod("ctl-cpu"))
    assert created.status_code == 201, created.text
    pod = created.json()
    assert pod["desiredStatus"] == "CREATED" and pod["gpuCount"] == 0
    assert pod["env"] == {"HELLO": "world"} and pod["ports"] == ["8888/http", "22/tcp"]
    assert pod["dockerArgs"] == "sh -c 'echo \"hi there\"; sleep 5'"
    assert pod["machine"]["podHostId"].startswith(pod["id"] + "-")
    assert pod["containerDiskInGb"] == 5
    pod_id = pod["id"]
    listed = api.get(f"{V1}/pods").json()
    assert [p["id"] for p in listed] == [pod_id]
    got = api.get(f"{V1}/pods/{pod_id}", params={"includeMachine": "true",
                                                 "includeNetworkVolume": "true"})
    assert got.status_code == 200 and got.json()["name"] == "ctl-cpu"
    restart = api.post(f"{V1}/pods/{pod_id}/restart")  # not placed yet: stopped at once
    assert restart.status_code == 200 and restart.json()["desiredStatus"] == "CREATED"
    reasons = [e["reason"] for e in api.get(f"/v1/pods/{pod_id}/events").json()]
    assert reasons[-2:] == ["StoppedByUser", "StartedByUser"], reasons
    stopped = api.post(f"{V1}/pods/{pod_id}/stop")
    assert stopped.status_code == 200 and stopped.json()["desiredStatus"] == "EXITED"
    started = api.post(f"{V1}/pods/{pod_id}/start")
    assert started.status_code == 200 and started.json()["desiredStatus"] == "CREATED"
    assert api.post(f"{V1}/pods/{pod_id}/stop").status_code == 200
    assert api.post(f"{V1}/pods/{pod_id}/reset").json()["desiredStatus"] == "CREATED"
    assert api.delete(f"{V1}/pods/{pod_id}").status_code == 204
    gone = api.get(f"{V1}/pods/{pod_id}")
    assert gone.status_code == 404 and gone.json()["status"] == 404


def test_v1_gpu_pod_takes_the_first_gpu_type_and_bad_input_names_the_field(
        api: TestClient, register_node: Callable[..., dict[str, Any]]) -> None:
    register_node("gpu-1")
    body = {"name": "ctl-gpu", "imageName": IMAGE, "gpuTypeIds": ["NVIDIA H100 80GB HBM3"],
            "gpuCount": 2, "volumeInGb": 20, "volumeMountPath": "/workspace",
            "cloudType": "SECURE", "dataCenterIds": ["US-TX-3"], "ports": ["22/tcp"]}
    pod = api.post(f"{V1}/pods", json=body).json()
    assert pod["gpuCount"] == 2 and pod["gpuTypeId"] == "NVIDIA H100 80GB HBM3"
    assert pod["volumeInGb"] == 20 and pod["volumeMountPath"] == "/workspace"
    assert pod["costPerHr"] > 0
    bad = api.post(f"{V1}/pods", json={**body, "name": "Not A DNS Name"})
    assert bad.status_code == 422 and bad.json()["error"].startswith("name")
    quotes = api.post(f"{V1}/pods", json={**body, "name": "q", "dockerArgs": "sh -c 'oops"})
    assert quotes.status_code == 422 and "dockerArgs" in quotes.json()["error"]
    # SkyPilot's REST v1 body: entrypoint and start command as arrays.
    sky = api.post(f"{V1}/pods", json={
        "name": "sky-head", "imageName": IMAGE, "computeType": "GPU", "cloudType": "SECURE",
        "gpuTypeIds": ["NVIDIA H100 80GB HBM3"], "gpuCount": 1, "minVCPUPerGPU": 4,
        "minRAMPerGPU": 16, "containerDiskInGb": 10, "supportPublicIp": True,
        "ports": ["22/tcp"], "dockerEntrypoint": ["bash", "-c"],
        "dockerStartCmd": ["echo hi; sleep infinity"]})
    assert sky.status_code == 201, sky.text
    assert sky.json()["vcpuCount"] == 4 and sky.json()["memoryInGb"] == 16


def test_v2_pods_pagination_actions_and_problem_errors(
        api: TestClient, register_node: Callable[..., dict[str, Any]],
        schedule: Callable[[], Any]) -> None:
    register_node("gpu-1")
    ids = []
    for index in range(3):
        response = api.post(f"{V2}/pods", json={
            "name": f"v2-{index}", "image": IMAGE, "args": "sleep 60", "disk": 5,
            "gpu": {"id": "NVIDIA H100 80GB HBM3", "count": 1}, "ports": ["8888/http"],
            "startSsh": True, "mounts": {"persistent": {"size": 10, "path": "/data"}}})
        assert response.status_code == 201, response.text
        ids.append(response.json()["id"])
    pod = api.get(f"{V2}/pods/{ids[0]}").json()
    assert pod["status"] == "PROVISIONING" and pod["actions"] == ["stop", "terminate"]
    assert pod["gpu"] == {"id": "NVIDIA H100 80GB HBM3", "count": 1} and pod["cpu"] is None
    assert pod["ports"] == ["8888/http", "22/tcp"] and pod["args"] == "sleep 60"
    assert pod["mounts"] == {"persistent": {"size": 10, "path": "/data"}}
    seen, cursor = [], None
    while True:
        page = api.get(f"{V2}/pods", params={"limit": 2, **({"cursor": cursor} if cursor
                                                            else {})}).json()
        seen += [p["id"] for p in page["pods"]]
        if not page["pagination"]["hasNextPage"]:
            break
        cursor = page["pagination"]["nextCursor"]
    assert seen == ids
    bad_cursor = api.get(f"{V2}/pods", params={"cursor": "bm8tc3VjaC1wb2Q"})
    assert bad_cursor.status_code == 422 and bad_cursor.json()["errors"][0].startswith("cursor")
    schedule()
    assert api.get(f"{V2}/pods/{ids[0]}").json()["status"] == "PROVISIONING"
    stopped = api.post(f"{V2}/pods/{ids[1]}/action", json={"action": "stop"})
    assert stopped.status_code == 200
    assert api.post(f"{V2}/pods/{ids[1]}/action", json={"action": "stop"}).status_code in {
        200, 409}
    assert api.post(f"{V2}/pods/{ids[2]}/action",
                    json={"action": "terminate"}).status_code == 204
    missing = api.get(f"{V2}/pods/{ids[2]}")
    assert missing.status_code == 404 and missing.json()["title"] == "Not Found"
    both = api.post(f"{V2}/pods", json={"name": "x", "image": IMAGE,
                                        "gpu": {"id": "NVIDIA H100 80GB HBM3"},
                                        "cpu": {"id": "cpu3c", "vcpuCount": 2}})
    assert both.status_code == 422 and both.json()["errors"] == [
        "cpu: give either gpu or cpu, not both"]
    unknown = api.post(f"{V2}/pods", json={"name": "x", "image": IMAGE, "bogus": 1})
    assert unknown.status_code == 422 and "bogus" in unknown.json()["detail"]
    edit = api.patch(f"{V2}/pods/{ids[0]}", json={"image": "other:latest"})
    assert edit.status_code == 409
    assert api.patch(f"{V2}/pods/{ids[0]}", json={"name": "v2-0"}).status_code == 200


def test_v2_templates_registries_catalog_and_ssh_keys(
        api: TestClient, register_node: Callable[..., dict[str, Any]]) -> None:
    registry = api.post(f"{V2}/registries", json={"name": "private", "username": "u",
                                                  "password": "p"})
    assert registry.status_code == 201, registry.text
    reg_id = registry.json()["id"]
    assert api.get(f"{V2}/registries").json() == {"registries": [{"id": reg_id,
                                                                  "name": "private"}]}
    template = api.post(f"{V2}/templates", json={
        "name": "tpl", "image": IMAGE, "args": "sleep 1", "ports": ["8888/http"],
        "env": {"A": "1"}, "registry": reg_id, "startSsh": False})
    assert template.status_code == 201, template.text
    tpl = template.json()
    assert tpl["registry"] == "private" and tpl["env"] == {"A": "1"}
    assert [t["id"] for t in api.get(f"{V2}/templates").json()["templates"]] == [tpl["id"]]
    pod = api.post(f"{V2}/pods", json={"name": "from-tpl", "templateId": tpl["id"],
                                       "cpu": {"id": "cpu3c", "vcpuCount": 2}}).json()
    assert pod["image"] == IMAGE and pod["template"] == "tpl" and pod["cpu"]["vcpuCount"] == 2
    assert api.get(f"{V2}/catalog/gpus/NVIDIA H100 80GB HBM3").status_code == 404
    register_node("gpu-1")
    gpu = api.get(f"{V2}/catalog/gpus/NVIDIA H100 80GB HBM3").json()
    assert gpu["memory"] == 80 and gpu["maxCount"]["secure"] == 8 and gpu["price"]["secure"] > 0
    keys = [asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
            for _ in range(2)]
    assert api.put(f"{V2}/account/ssh-keys", json={"keys": keys}).json() == {"keys": keys}
    assert api.put(f"{V2}/account/ssh-keys", json={"keys": keys[1:]}).json() == {
        "keys": keys[1:]}
    bad = api.put(f"{V2}/account/ssh-keys", json={"keys": [keys[0], "ssh-ed25519 nope"]})
    assert bad.status_code == 422 and bad.json()["errors"][0].startswith("keys[1]")
    assert api.get(f"{V2}/account/ssh-keys").json() == {"keys": keys[1:]}
    assert api.delete(f"{V2}/registries/{reg_id}").status_code == 204


def test_runpodctl_graphql_create_pod_with_variables(
        api: TestClient, register_node: Callable[..., dict[str, Any]]) -> None:
    """runpodctl's createPodGraphQL (internal/api/graphql.go): a document with
    ``$input: PodFindAndDeployOnDemandInput!`` and the input in ``variables``."""
    register_node("gpu-1")
    document = """
        mutation createPod($input: PodFindAndDeployOnDemandInput!) {
            podFindAndDeployOnDemand(input: $input) {
                id name imageName desiredStatus costPerHr containerDiskInGb volumeInGb
                volumeMountPath gpuCount memoryInGb vcpuCount ports lastStatusChange env
                machine { gpuDisplayName location }
            }
        }"""
    variables = {"input": {
        "cloudType": "SECURE", "containerDiskInGb": 10, "gpuCount": 1,
        "gpuTypeId": "NVIDIA H100 80GB HBM3", "imageName": IMAGE, "name": "ctl-gql",
        "startSsh": True, "volumeInGb": 20, "volumeMountPath": "/workspace",
        "ports": "8888/http,22/tcp", "env": [{"key": "A", "value": "b c"}],
        "dockerArgs": "sh -c 'echo \"quoted\"'"}}
    response = api.post("/graphql", json={"query": document, "variables": variables})
    assert response.status_code == 200, response.text
    body = response.json()
    assert "errors" not in body, body
    pod = body["data"]["podFindAndDeployOnDemand"]
    assert pod["name"] == "ctl-gql" and pod["env"] == ["A=b c"] and pod["gpuCount"] == 1
    rest = api.get(f"{V1}/pods/{pod['id']}").json()
    assert rest["dockerArgs"] == "sh -c 'echo \"quoted\"'"
