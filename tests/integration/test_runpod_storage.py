"""RunPod's network volumes, registry credentials, in-place restart and bid resume on the
in-process app (both databases), through GraphQL (the SDK's literal documents, runpodctl's
variables) and REST v1 (runpodctl's ``/networkvolumes``, ``/containerregistryauth``),
each landing on gpucloud's own volumes, registry credentials and pods. Also: the GPU
catalog is one computation behind GraphQL ``gpuTypes`` and REST ``/catalog/gpus``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient
from runpod.api.mutations.container_register_auth import (
    delete_container_registry_auth,
    generate_container_registry_auth,
)

from gpucloud.compat.runpod import actions
from gpucloud.core.clock import ManualClock
from gpucloud.core.settings import Settings
from tests.integration.conftest import agent_headers
from tests.integration.test_runpod_graphql import data, gql

V1 = "/runpod/v1"
H100 = "NVIDIA H100 80GB HBM3"
CREATE_VOLUME = ("mutation CreateNetworkVolume($input: CreateNetworkVolumeInput!) { "
                 "createNetworkVolume(input: $input) { id name size dataCenterId } }")


def _error(out: dict[str, Any]) -> str:
    assert "errors" in out, out
    return str(out["errors"][0]["message"])


def test_graphql_network_volume_create_mount_delete(api: TestClient) -> None:
    made = data(api, CREATE_VOLUME, {"input": {"name": "data", "size": 50,
                                               "dataCenterId": "US-TX-3"}})
    assert made["createNetworkVolume"] == {"id": "data", "name": "data", "size": 50,
                                           "dataCenterId": "us-tx-3"}
    native = api.get("/v1/volumes/data").json()
    assert native["size_bytes"] == 50 * 1024**3 and native["zone"] == "us-tx-3"
    listed = data(api, "query { myself { networkVolumes { id size dataCenterId } } }")
    assert listed["myself"]["networkVolumes"] == [
        {"id": "data", "size": 50, "dataCenterId": "us-tx-3"}]
    bad = gql(api, CREATE_VOLUME, {"input": {"name": "Not OK", "size": 1}})
    assert _error(bad).startswith("name") and len(api.get("/v1/volumes").json()) == 1
    pod = data(api, 'mutation { deployCpuPod(input: {name: "nv", imageName: "busybox", '
               'networkVolumeId: "data", volumeMountPath: "/data"}) { id networkVolumeId '
               "volumeMountPath } }")["deployCpuPod"]
    assert pod["networkVolumeId"] == "data" and pod["volumeMountPath"] == "/data"
    delete = 'mutation { deleteNetworkVolume(input: {id: "data"}) }'
    assert "mounted by pod nv" in _error(gql(api, delete))
    assert api.get("/v1/volumes/data").status_code == 200  # nothing deleted
    data(api, f'mutation {{ podTerminate(input: {{podId: "{pod["id"]}"}}) }}')
    assert data(api, delete) == {"deleteNetworkVolume": None}
    assert api.get("/v1/volumes/data").status_code == 404
    assert "not found" in _error(gql(api, delete))


def test_rest_v1_network_volumes(api: TestClient) -> None:
    created = api.post(f"{V1}/networkvolumes", json={"name": "ckpt", "size": 10,
                                                     "dataCenterId": "EU-RO-1"})
    assert created.status_code == 201, created.text
    assert created.json() == {"id": "ckpt", "name": "ckpt", "size": 10,
                              "dataCenterId": "eu-ro-1"}
    assert api.get(f"{V1}/networkvolumes").json() == [created.json()]
    assert api.get(f"{V1}/networkvolumes/ckpt").json() == created.json()
    for body, field in (({"name": "x", "size": 0}, "size"),
                        ({"name": "Bad_Name", "size": 1}, "name"),
                        ({"name": "x", "size": 1, "dataCenterId": "no spaces"},
                         "dataCenterId")):
        bad = api.post(f"{V1}/networkvolumes", json=body)
        assert bad.status_code == 422 and bad.json()["error"].startswith(field), bad.text
    assert len(api.get("/v1/volumes").json()) == 1
    assert api.delete(f"{V1}/networkvolumes/ckpt").status_code == 204
    missing = api.get(f"{V1}/networkvolumes/ckpt")
    assert missing.status_code == 404 and missing.json()["status"] == 404


def test_registry_auth_graphql_sdk_documents_and_rest_v1(api: TestClient) -> None:
    saved = data(api, generate_container_registry_auth("ghcr", "me", "secret"))
    auth = saved["saveRegistryAuth"]
    assert auth["name"] == "ghcr" and auth["id"]
    assert "password" not in str(api.get("/v1/registry-auths").json())
    creds = data(api, "query { myself { containerRegistryCreds { id name } } }")
    assert creds["myself"]["containerRegistryCreds"] == [auth]
    pod = data(api, 'mutation { deployCpuPod(input: {name: "priv", imageName: "ghcr.io/me/x", '
               f'containerRegistryAuthId: "{auth["id"]}"}}) {{ id }} }}')["deployCpuPod"]
    assert api.get(f"/v1/pods/{pod['id']}").json()["registry_auth"] == "ghcr"
    template = data(api, 'mutation { saveTemplate(input: {name: "t", imageName: "ghcr.io/me/x", '
                    f'containerRegistryAuthId: "{auth["id"]}"}}) {{ id }} }}')["saveTemplate"]
    assert api.get(f"/v1/templates/{template['id']}").json()["registry_auth"] == "ghcr"
    # what SkyPilot reads back to find the credentials to delete at teardown
    listed = data(api, "query { myself { pods { containerRegistryAuthId } podTemplates { "
                  "name containerRegistryAuthId } } }")["myself"]
    assert listed["pods"] == [{"containerRegistryAuthId": auth["id"]}]
    assert listed["podTemplates"] == [{"name": "t", "containerRegistryAuthId": auth["id"]}]
    assert data(api, 'mutation {deleteTemplate(templateName: "t")}') == {"deleteTemplate": None}
    assert api.get(f"/v1/templates/{template['id']}").status_code == 404
    unknown = gql(api, 'mutation { deployCpuPod(input: {name: "u", imageName: "busybox", '
                  'containerRegistryAuthId: "nope"}) { id } }')
    assert _error(unknown).startswith("containerRegistryAuthId")
    assert data(api, delete_container_registry_auth(auth["id"])) == {"deleteRegistryAuth": None}
    assert "not found" in _error(gql(api, delete_container_registry_auth(auth["id"])))
    # REST v1, as runpodctl's container registry auth routes
    made = api.post(f"{V1}/containerregistryauth",
                    json={"name": "hub", "username": "u", "password": "p"})
    assert made.status_code == 201 and set(made.json()) == {"id", "name"}
    assert api.get(f"{V1}/containerregistryauth").json() == [made.json()]
    assert api.get(f"{V1}/containerregistryauth/hub").json() == made.json()
    bad = api.post(f"{V1}/containerregistryauth", json={"name": "hub2", "username": "u"})
    assert bad.status_code == 422 and "password" in bad.json()["error"]
    assert api.delete(f"{V1}/containerregistryauth/{made.json()['id']}").status_code == 204
    assert api.get(f"{V1}/containerregistryauth").json() == []


def _assignment(api: TestClient, reg: dict[str, Any]) -> dict[str, Any] | None:
    pods: list[dict[str, Any]] = api.get("/v1/agent/assignments",
                                         headers=agent_headers(reg)).json()["pods"]
    return pods[0] if pods else None


def _report(api: TestClient, reg: dict[str, Any], pod: dict[str, Any], phase: str) -> None:
    response = api.post(f"/v1/agent/pods/{pod['pod_id']}/status", headers=agent_headers(reg),
                        json={"fencing_token": reg["fencing_token"], "phase": phase,
                              "attempt": pod["attempt"]})
    assert response.status_code == 200, response.text


def _running_pod(api: TestClient, reg: dict[str, Any], schedule: Callable[[], Any]
                 ) -> str:
    pod = data(api, 'mutation { podFindAndDeployOnDemand(input: {name: "lab", imageName: '
               f'"busybox", gpuTypeId: "{H100}", gpuCount: 1, volumeInGb: 5}}) {{ id }} }}')
    schedule()
    assignment = _assignment(api, reg)
    assert assignment is not None
    _report(api, reg, assignment, "Running")
    return str(pod["podFindAndDeployOnDemand"]["id"])


def _reasons(api: TestClient, pod_id: str) -> list[str]:
    return [e["reason"] for e in api.get(f"/v1/pods/{pod_id}/events").json()]


def test_pod_restart_answers_at_once_and_the_agents_stop_report_starts_it_again(
        api: TestClient, register_node: Callable[..., dict[str, Any]],
        schedule: Callable[[], Any]) -> None:
    """No request waits for the agent: the restart is a mark on the pod, and the agent's
    report that the pod stopped is what starts it again, in place."""
    reg = register_node("gpu-1")
    pod_id = _running_pod(api, reg, schedule)
    restart = (f'mutation {{ podRestart(input: {{podId: "{pod_id}"}}) '
               "{ desiredStatus volumeInGb } }")
    assert data(api, restart)["podRestart"] == {"desiredStatus": "RESTARTING", "volumeInGb": 5}
    again = api.post(f"{V1}/pods/{pod_id}/restart")  # asked again while it stops: once
    assert again.status_code == 200 and again.json()["desiredStatus"] == "RESTARTING"
    assert _reasons(api, pod_id).count("RestartRequested") == 1
    native = api.get(f"/v1/pods/{pod_id}").json()
    assert (native["phase"], native["desired_state"]) == ("Running", "restarting")
    pending = _assignment(api, reg)  # to the agent, a stop with the restart's grace
    assert pending is not None and pending["desired_state"] == "stopped"
    assert pending["stop_grace_seconds"] == actions.RESTART_GRACE_SECONDS
    response = api.post(f"/v1/agent/pods/{pod_id}/status", headers=agent_headers(reg),
                        json={"fencing_token": reg["fencing_token"], "phase": "Stopped",
                              "attempt": pending["attempt"]})
    assert response.json() == {"phase": "Pending"}
    native = api.get(f"/v1/pods/{pod_id}").json()
    assert (native["phase"], native["desired_state"]) == ("Pending", "running")
    assert native["volume_size"] == 5 * 1024**3 and native["volume_node"] == "gpu-1"
    schedule()
    placed = _assignment(api, reg)  # the volume disk's node, a new attempt
    assert placed is not None and placed["attempt"] > pending["attempt"]
    assert placed["desired_state"] == "running"
    reasons = _reasons(api, pod_id)
    assert reasons.index("RestartedByUser") > reasons.index("RestartRequested")


def test_a_stop_cancels_a_restart_and_a_lost_node_completes_one(
        api: TestClient, register_node: Callable[..., dict[str, Any]],
        schedule: Callable[[], Any], expire_leases: Callable[[], list[str]],
        clock: ManualClock, settings: Settings) -> None:
    reg = register_node("gpu-1")
    pod_id = _running_pod(api, reg, schedule)
    restarting = api.post(f"/runpod/v2/pods/{pod_id}/restart")
    assert restarting.status_code == 200 and restarting.json()["status"] == "RUNNING"
    assert api.post(f"{V1}/pods/{pod_id}/stop").json()["desiredStatus"] == "EXITED"
    assignment = _assignment(api, reg)
    assert assignment is not None
    _report(api, reg, assignment, "Stopped")
    assert api.get(f"/v1/pods/{pod_id}").json()["phase"] == "Stopped"  # the stop won
    done = api.post(f"/runpod/v2/pods/{pod_id}/action", json={"action": "restart"})
    assert done.status_code == 200 and done.json()["status"] == "PROVISIONING"  # ended: starts
    schedule()
    assignment = _assignment(api, reg)
    assert assignment is not None
    _report(api, reg, assignment, "Running")
    assert data(api, f'mutation {{ podRestart(input: {{podId: "{pod_id}"}}) '
                "{ desiredStatus } }")["podRestart"] == {"desiredStatus": "RESTARTING"}
    clock.advance(settings.lease_ttl_seconds + 1)  # its agent never reports again
    assert expire_leases() == ["gpu-1"]
    native = api.get(f"/v1/pods/{pod_id}").json()
    assert (native["phase"], native["desired_state"]) == ("Pending", "running")
    assert _reasons(api, pod_id)[-2:] == ["NodeLost", "RestartedByUser"]


def test_bid_resume_records_the_new_bid(api: TestClient,
                                        register_node: Callable[..., dict[str, Any]]) -> None:
    register_node("gpu-1")
    spot = data(api, "mutation { podRentInterruptable(input: {bidPerGpu: 1.2, name: \"s\", "
                f'imageName: "busybox", gpuTypeId: "{H100}", gpuCount: 1}}) {{ id }} }}')
    pod_id = spot["podRentInterruptable"]["id"]
    resume = ('mutation {{ podBidResume(input: {{podId: "{}", bidPerGpu: {}, gpuCount: 1}}) '
              "{{ desiredStatus bidPerGpu podType }} }}")
    assert "only an ended pod" in _error(gql(api, resume.format(pod_id, 2.5)))
    data(api, f'mutation {{ podStop(input: {{podId: "{pod_id}"}}) {{ id }} }}')
    assert _error(gql(api, resume.format(pod_id, 0))).startswith("bidPerGpu")
    assert api.get(f"/v1/pods/{pod_id}").json()["bid"] == 1.2  # nothing written
    out = data(api, resume.format(pod_id, 2.5))["podBidResume"]
    assert out == {"desiredStatus": "CREATED", "bidPerGpu": 2.5, "podType": "INTERRUPTABLE"}
    assert api.get(f"/v1/pods/{pod_id}").json()["bid"] == 2.5
    events = api.get(f"/v1/pods/{pod_id}/events").json()
    assert any(e["reason"] == "BidChanged" and "1.2 → 2.5" in e["message"] for e in events)
    plain = data(api, 'mutation { deployCpuPod(input: {name: "c", imageName: "busybox"}) '
                 "{ id } }")["deployCpuPod"]["id"]
    data(api, f'mutation {{ podStop(input: {{podId: "{plain}"}}) {{ id }} }}')
    assert _error(gql(api, resume.format(plain, 1))).startswith("podId")


def test_one_gpu_catalog_behind_graphql_and_rest(
        api: TestClient, register_node: Callable[..., dict[str, Any]]) -> None:
    register_node("gpu-1")
    l4 = [{"uuid": f"GPU-L4-{i}", "model": "NVIDIA L4", "memory_mib": 23034, "numa_node": 0,
           "nvlink_peers": []} for i in range(2)]
    register_node("gpu-2", gpus=l4)
    assert api.post("/v1/nodes/gpu-2/cordon").status_code == 200
    graph = data(api, "query { gpuTypes { id memoryInGb securePrice maxGpuCount } }")
    rest = api.get("/runpod/v2/catalog/gpus").json()["gpuTypes"]
    assert [g["id"] for g in graph["gpuTypes"]] == [g["id"] for g in rest] == [
        H100, "NVIDIA L4"]
    for gql_type, rest_type in zip(graph["gpuTypes"], rest, strict=True):
        assert gql_type["memoryInGb"] == rest_type["memory"]
        assert gql_type["securePrice"] == rest_type["price"]["secure"]
    # a cordoned node's GPUs are listed (REST: most on a node) but none is free (GraphQL)
    assert graph["gpuTypes"][1]["maxGpuCount"] == 0 and rest[1]["maxCount"]["secure"] == 2
    assert graph["gpuTypes"][0]["maxGpuCount"] == rest[0]["maxCount"]["secure"] == 8
