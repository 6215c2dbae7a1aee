"""The real ``runpod`` SDK (PyPI, test extras) against a live server with a real agent:
``RUNPOD_API_BASE_URL`` points at the server; nothing of the SDK is patched. Also the
spot pod SkyPilot creates, through the SDK's ``run_graphql_query`` with the document
shape of SkyPilot's ``generate_spot_pod_deployment_mutation``
(sky/provision/runpod/api/pods.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import runpod
from runpod.api.graphql import run_graphql_query

from tests.e2e.cluster import ADMIN_KEY, Cloud, wait_for
from tests.e2e.conftest import PushedImages

H100 = "NVIDIA H100 80GB HBM3"
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGb3rGcZ0UhXP3m8Q1rWDtbQ0pkyG8zU+1zY4R5FUY9u"


@pytest.fixture
def sdk(cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cloud]:
    monkeypatch.setenv("RUNPOD_API_BASE_URL", cloud.url)
    monkeypatch.setattr(runpod, "api_key", ADMIN_KEY)
    cloud.agent("gpu-a")
    yield cloud


def _status(pod_id: str, *wanted: str) -> dict[str, object]:
    def check() -> dict[str, object] | None:
        pod = runpod.get_pod(pod_id)
        return pod if pod["desiredStatus"] in wanted and (
            pod["desiredStatus"] != "RUNNING" or pod["runtime"]) else None

    return wait_for(check, 30, f"pod {pod_id} to be {wanted}")


def test_sdk_pod_lifecycle(sdk: Cloud, images: PushedImages) -> None:
    assert {"id": H100, "displayName": "H100 SXM", "memoryInGb": 80} in runpod.get_gpus()
    assert runpod.get_gpu(H100, 2)["lowestPrice"]["uninterruptablePrice"] == 5.98
    pod = runpod.create_pod("lab", images.busybox, H100, gpu_count=1,
                            docker_args="sh -c 'echo ready; sleep 600'",
                            ports="8888/http", env={"A": "1"}, volume_in_gb=1)
    assert pod["machine"]["podHostId"].startswith(pod["id"] + "-") and pod["env"] == ["A=1"]
    running = _status(pod["id"], "RUNNING")
    assert sdk.wait_log("lab", "ready") == "ready\n"
    ports = running["runtime"]["ports"]  # type: ignore[index]
    assert ports[0]["privatePort"] == 22 and ports[0]["isIpPublic"]  # startSsh: 22/tcp
    assert any(not p["isIpPublic"] for p in ports)  # the private entry SkyPilot needs
    assert [p["id"] for p in runpod.get_pods()] == [pod["id"]]
    cpu = runpod.create_pod("cpu", images.busybox, instance_id="cpu3c-2-4",
                            docker_args="sleep 600")
    assert runpod.get_pod(cpu["id"])["vcpuCount"] == 2
    runpod.stop_pod(pod["id"])
    sdk.wait_pod("lab", "Stopped")
    assert runpod.get_pod(pod["id"])["desiredStatus"] == "EXITED"
    runpod.resume_pod(pod["id"], 1)
    _status(pod["id"], "RUNNING")
    runpod.terminate_pod(pod["id"])
    runpod.terminate_pod(cpu["id"])
    assert runpod.get_pods() == []


def test_sdk_account_template_and_skypilot_spot(sdk: Cloud, images: PushedImages) -> None:
    assert runpod.update_user_settings(KEY)["pubKey"] == KEY
    assert runpod.get_user()["pubKey"] == KEY
    template = runpod.create_template("lab-tpl", images.busybox, docker_start_cmd="sleep 5")
    assert template["name"] == "lab-tpl" and template["dockerArgs"] == "sleep 5"
    docker_args = "sh -c 'echo c3BvdA== | base64 -d; sleep 600'"
    query = f"""
    mutation {{
      podRentInterruptable(
        input: {{
          name: "sky-head", imageName: "{images.busybox}", gpuTypeId: "{H100}", bidPerGpu: 1.2, volumeMountPath: "/runpod-volume", cloudType: SECURE, startSsh: true, supportPublicIp: true, gpuCount: 1, minMemoryInGb: 1, minVcpuCount: 4, containerDiskInGb: 10, volumeInGb: 0, ports: "22/tcp,8265/http", dockerArgs: "{docker_args}", dataCenterId: "local", countryCode: "US"
        }}
      ) {{
        id
        desiredStatus
        imageName
        env
        machineId
        machine {{
          podHostId
        }}
      }}
    }}
    """  # noqa: E501 - one line, as SkyPilot joins its fields
    pod = run_graphql_query(query)["data"]["podRentInterruptable"]
    assert sdk.wait_log("sky-head", "spot") == "spot"
    native = sdk.client.get_pod(pod["id"])
    assert native.spot and native.bid == 1.2
    assert runpod.get_pod(pod["id"])["podType"] == "INTERRUPTABLE"
    runpod.terminate_pod(pod["id"])


def test_sdk_network_volume_registry_auth_and_in_place_restart(
        sdk: Cloud, images: PushedImages) -> None:
    """The SDK's registry-auth helpers; a network volume made with runpodctl's
    ``createNetworkVolume``, mounted by ``create_pod(network_volume_id=…)`` (which looks
    the volume's data center up with ``get_user``); ``podRestart`` stops the running pod
    and starts the same pod again, its volume kept (the boot count goes to 2)."""
    auth = runpod.create_container_registry_auth("hub", "someone", "secret")
    assert auth["name"] == "hub" and sdk.client.list_registry_auths()[0].id == auth["id"]
    assert runpod.delete_container_registry_auth(auth["id"]) is None
    volume = run_graphql_query('mutation { createNetworkVolume(input: {name: "shared", '
                               'size: 1, dataCenterId: "US-TX-3"}) { id dataCenterId } }')
    assert volume["data"]["createNetworkVolume"] == {"id": "shared", "dataCenterId": "us-tx-3"}
    boots = ("sh -c 'trap exit TERM; echo x >> /shared/boots; "
             "echo boots=$(wc -l < /shared/boots); sleep 600 & wait'")
    pod = runpod.create_pod("boots", images.busybox, H100, gpu_count=1, docker_args=boots,
                            network_volume_id="shared", volume_mount_path="/shared")
    _status(pod["id"], "RUNNING")
    sdk.wait_log("boots", "boots=1")
    restarted = run_graphql_query(f'mutation {{ podRestart(input: {{podId: "{pod["id"]}"}}) '
                                  "{ id desiredStatus } }")["data"]["podRestart"]
    assert restarted == {"id": pod["id"], "desiredStatus": "RESTARTING"}  # answered at once
    _status(pod["id"], "RUNNING")
    sdk.wait_log("boots", "boots=2")
    runpod.terminate_pod(pod["id"])
    gone = run_graphql_query('mutation { deleteNetworkVolume(input: {id: "shared"}) }')
    assert gone == {"data": {"deleteNetworkVolume": None}}
    assert sdk.client.list_volumes() == []
