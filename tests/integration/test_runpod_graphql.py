"""RunPod's GraphQL API (``POST /graphql``) on the in-process app: inline literals as the
``runpod`` SDK writes them, variables as runpodctl and dstack send them, the three ways of
sending the key, errors as HTTP 200 ``{"errors": …}``, and every pod going through the
ordinary pod service (same validation, scheduling, events)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.conftest import ADMIN_KEY

POD_FIELDS = ("id name desiredStatus imageName env machineId costPerHr gpuCount volumeInGb "
              "containerDiskInGb volumeMountPath dockerArgs ports podType bidPerGpu "
              "machine { podHostId gpuDisplayName } runtime { ports { ip isIpPublic "
              "privatePort publicPort type } }")
ED25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGb3rGcZ0UhXP3m8Q1rWDtbQ0pkyG8zU+1zY4R5FUY9u a@b"


def gql(api: TestClient, query: str, variables: dict[str, Any] | None = None,
        **kwargs: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"query": query}
    if variables is not None:
        body["variables"] = variables
    response = api.post("/graphql", json=body, **kwargs)
    assert response.status_code == 200, response.text
    return dict(response.json())


def data(api: TestClient, query: str, variables: dict[str, Any] | None = None
         ) -> dict[str, Any]:
    out = gql(api, query, variables)
    assert "errors" not in out, out
    return dict(out["data"])


@pytest.fixture
def fleet(register_node: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    return register_node("gpu-1")


def test_keys_in_three_forms(app_client: TestClient) -> None:
    query = {"query": "query { myself { id } }"}
    for kwargs in ({"headers": {"Authorization": f"Bearer {ADMIN_KEY}"}},
                   {"headers": {"Authorization": ADMIN_KEY}},
                   {"params": {"api_key": ADMIN_KEY}}):
        response = app_client.post("/graphql", json=query, **kwargs)  # type: ignore[arg-type]
        assert response.status_code == 200 and response.json()["data"]["myself"]["id"]
    bad = app_client.post("/graphql", json=query, headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["errors"][0]["message"]


def test_gpu_types_from_the_fleet(api: TestClient, fleet: dict[str, Any]) -> None:
    del fleet
    out = data(api, 'query { gpuTypes(input: {id: "NVIDIA H100 80GB HBM3"}) { id displayName '
               "memoryInGb secureCloud communityCloud lowestPrice(input: {gpuCount: 2}) "
               "{ minimumBidPrice uninterruptablePrice } } }")
    (h100,) = out["gpuTypes"]
    assert h100["id"] == "NVIDIA H100 80GB HBM3" and h100["memoryInGb"] == 80
    assert h100["lowestPrice"] == {"minimumBidPrice": 3.58, "uninterruptablePrice": 5.98}
    too_many = data(api, "query { gpuTypes { lowestPrice(input: {gpuCount: 9}) "
                    "{ uninterruptablePrice } } }")
    assert too_many["gpuTypes"] == [{"lowestPrice": {"uninterruptablePrice": None}}]
    assert data(api, 'query { gpuTypes(input: {id: "NVIDIA B200"}) { id } }') == {
        "gpuTypes": []}


def test_sdk_literal_create_with_quotes(api: TestClient, fleet: dict[str, Any],
                                        schedule: Callable[[], Any]) -> None:
    """The SDK's own document shape: enum literal, explicit null, quotes in dockerArgs."""
    del fleet
    mutation = ('mutation { podFindAndDeployOnDemand(input: { name: "lab", imageName: '
                '"busybox:1", cloudType: ALL, startSsh: true, gpuTypeId: "NVIDIA H100 80GB '
                'HBM3", supportPublicIp: true, gpuCount: 2, volumeInGb: 20, '
                'dataCenterId: null, dockerArgs: "sh -c \'echo \\"hi there\\"; sleep 9\'", '
                'containerDiskInGb: 10, ports: "8888/http,22/tcp", volumeMountPath: "/work", '
                'env: [{ key: "A", value: "1" }, { key: "B", value: "x=y" }] }) { '
                + POD_FIELDS + " } }")
    pod = data(api, mutation)["podFindAndDeployOnDemand"]
    assert pod["desiredStatus"] == "CREATED" and pod["env"] == ["A=1", "B=x=y"]
    assert pod["dockerArgs"] == "sh -c 'echo \"hi there\"; sleep 9'"
    assert pod["costPerHr"] == 5.98 and pod["gpuCount"] == 2 and pod["podType"] == "RESERVED"
    assert pod["volumeInGb"] == 20 and pod["volumeMountPath"] == "/work"
    assert pod["machine"]["podHostId"].startswith(pod["id"] + "-")
    assert len(pod["machine"]["podHostId"]) == len(pod["id"]) + 9
    native = api.get(f"/v1/pods/{pod['id']}").json()
    assert native["command"] == ["sh", "-c", 'echo "hi there"; sleep 9']
    assert native["gpu_type"] == "H100-80GB" and native["ports"] == ["8888/http", "22/tcp"]
    schedule()
    got = data(api, f'query {{ pod(input: {{podId: "{pod["id"]}"}}) {{ machineId '
               "machine { gpuDisplayName } } }")["pod"]
    assert got == {"machineId": "gpu-1", "machine": {"gpuDisplayName": "H100 SXM"}}


def test_variables_spot_stop_resume_terminate(api: TestClient, fleet: dict[str, Any]) -> None:
    """runpodctl / dstack style: typed variables; spot records the bid; lifecycle."""
    del fleet
    create = ("mutation createPod($input: PodRentInterruptableInput!) { "
              "podRentInterruptable(input: $input) { id podType bidPerGpu costPerHr } }")
    pod = data(api, create, {"input": {
        "bidPerGpu": 1.5, "cloudType": "SECURE", "gpuCount": 1, "name": "spotty",
        "gpuTypeId": "NVIDIA H100 80GB HBM3", "imageName": "busybox:1", "dockerArgs": "",
        "containerRegistryAuthId": "", "env": [{"key": "K", "value": "V"}]}})
    pod = pod["podRentInterruptable"]
    assert pod["podType"] == "INTERRUPTABLE" and pod["bidPerGpu"] == 1.5
    assert pod["costPerHr"] == 1.79
    assert api.get(f"/v1/pods/{pod['id']}").json()["spot"] is True
    stop = data(api, "mutation s($i: PodStopInput!) { podStop(input: $i) { desiredStatus } }",
                {"i": {"podId": pod["id"]}})
    assert stop["podStop"]["desiredStatus"] == "EXITED"
    resumed = data(api, f'mutation {{ podResume(input: {{podId: "{pod["id"]}", '
                   "gpuCount: 1}) { desiredStatus } }")
    assert resumed["podResume"]["desiredStatus"] == "CREATED"
    terminate = f'mutation {{ podTerminate(input: {{podId: "{pod["id"]}"}}) }}'
    assert data(api, terminate) == {"podTerminate": None}
    assert api.get(f"/v1/pods/{pod['id']}").status_code == 404


def test_cpu_pod_and_errors(api: TestClient) -> None:
    cpu = data(api, 'mutation { deployCpuPod(input: { name: "cpu", imageName: "busybox:1", '
               'cloudType: SECURE, instanceId: "cpu3c-2-4", templateId: "runpod-ubuntu", '
               "dataCenterId: null }) { id gpuCount vcpuCount memoryInGb costPerHr } }")
    assert cpu["deployCpuPod"]["vcpuCount"] == 2 and cpu["deployCpuPod"]["memoryInGb"] == 4
    assert cpu["deployCpuPod"]["gpuCount"] == 0 and cpu["deployCpuPod"]["costPerHr"] == 0.06
    bad = gql(api, 'mutation { deployCpuPod(input: { name: "Bad Name!", imageName: "b" }) '
              "{ id } }")
    assert bad["errors"][0]["message"].startswith("name:")
    quote = gql(api, 'mutation { deployCpuPod(input: { name: "q", imageName: "b", '
                'dockerArgs: "sh -c \'unterminated" }) { id } }')
    assert quote["errors"][0]["message"].startswith("dockerArgs:")
    unknown = gql(api, "query { myself { nope } }")
    assert "nope" in unknown["errors"][0]["message"] and "data" not in unknown
    missing = gql(api, 'query { pod(input: {podId: "0123"}) { id } }')
    assert missing["data"] == {"pod": None} and "not found" in missing["errors"][0]["message"]
    names = [p["name"] for p in data(api, "query { myself { pods { name } } }")["myself"]["pods"]]
    assert names == ["cpu"]  # nothing half-written by the refused ones


def test_pub_key_and_template(api: TestClient) -> None:
    out = data(api, f'mutation {{ updateUserSettings(input: {{pubKey: "{ED25519}"}}) '
               "{ id pubKey } }")
    assert out["updateUserSettings"]["pubKey"] == ED25519.rsplit(" ", 1)[0]
    bad = gql(api, f'mutation {{ updateUserSettings(input: {{pubKey: "{ED25519}\\nssh-rsa '
              'junk"}) { pubKey } }')
    assert bad["errors"][0]["message"].startswith("pubKey[1]:")
    assert len(api.get("/v1/ssh-keys").json()) == 1
    cleared = data(api, 'mutation { updateUserSettings(input: {pubKey: ""}) { pubKey } }')
    assert cleared["updateUserSettings"]["pubKey"] == ""
    template = data(api, 'mutation { saveTemplate(input: { name: "lab", imageName: "busybox:1",'
                    ' dockerArgs: "sleep 1", containerDiskInGb: 10, volumeInGb: 0, ports: "", '
                    'env: [], isServerless: false, containerRegistryAuthId : "", '
                    'startSsh: true, isPublic: false, readme: "" }) { id name imageName '
                    "dockerArgs ports env { key value } } }")["saveTemplate"]
    assert template["dockerArgs"] == "sleep 1" and template["ports"] == "22/tcp"
    assert api.get("/v1/templates/lab").json()["command"] == ["sleep", "1"]
