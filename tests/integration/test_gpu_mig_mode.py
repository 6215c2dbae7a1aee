"""`node mig-mode NODE GPU --on|--off` through the REST API and the agent protocol (both
databases): the GPU leaves scheduling when asked, the switch reaches the agent only once no
pod holds the GPU (409 without a wait), a switch that waited in vain fails, and a passed
one sets the inventory's `mig_mode`, which placement follows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from gpucloud.core.clock import ManualClock
from tests.integration.conftest import agent_headers, gpu_actions, h100_gpus, renew_lease

Tick = Callable[[], Any]


def _mig_gpus(count: int, *, on: bool = False) -> list[dict[str, Any]]:
    gpus = h100_gpus(count)
    for gpu in gpus:
        gpu.update(mig_capable=True, mig_mode=on)
    return gpus


def _pod(api: TestClient, name: str, **spec: Any) -> None:
    response = api.post("/v1/pods", json={"name": name, "image": "busybox", **spec})
    assert response.status_code == 201, response.text


def _stopped(api: TestClient, node: dict[str, Any], pod: dict[str, Any]) -> None:
    """What the agent does with a pod it stopped (``pod``: its assignment): report it."""
    response = api.post(f"/v1/agent/pods/{pod['pod_id']}/status", headers=agent_headers(node),
                        json={"fencing_token": node["fencing_token"], "phase": "Stopped",
                              "attempt": pod["attempt"]})
    assert response.status_code == 200, response.text


def _phase(api: TestClient, name: str) -> str:
    phase: str = api.get(f"/v1/pods/{name}").json()["phase"]
    return phase


def test_mig_on_takes_the_gpu_out_then_placement_follows_the_new_mode(
        api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Tick) -> None:
    gpus = _mig_gpus(1)
    node = register_node("sw", gpus=gpus)
    asked = api.post("/v1/nodes/sw/gpu-actions", json={"action": "mig-on", "gpu": 0})
    assert asked.status_code == 200, asked.text
    maintenance = asked.json()["gpus"][0]["maintenance"]
    assert maintenance["action"] == "mig-on" and maintenance["state"] == "requested"
    _pod(api, "whole", gpus=1)  # the GPU is out of scheduling while it switches
    schedule()
    assert _phase(api, "whole") == "Pending"
    [action] = gpu_actions(api, node)
    assert action["action"] == "mig-on" and action["gpu_uuid"] == gpus[0]["uuid"]
    renew_lease(api, node, gpu_actions=[{"id": action["id"], "passed": True,
                                    "output": "simulated MIG mode on on GPU 0"}])
    shown = api.get("/v1/nodes/sw").json()["gpus"][0]
    assert shown["mig_mode"] is True and shown["maintenance"]["state"] == "passed"
    assert gpu_actions(api, node) == []
    _pod(api, "slice", mig="1g.10gb")
    schedule()
    assert _phase(api, "slice") == "Scheduled"  # MIG mode on: MIG pods only
    assert _phase(api, "whole") == "Pending"


def test_a_failed_switch_keeps_the_mode_and_puts_the_gpu_back(
        api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Tick) -> None:
    node = register_node("nope", gpus=_mig_gpus(1, on=True))
    assert api.post("/v1/nodes/nope/gpu-actions",
                    json={"action": "mig-off", "gpu": 0}).status_code == 200
    [action] = gpu_actions(api, node)
    renew_lease(api, node, gpu_actions=[{"id": action["id"], "passed": False,
                                    "output": "GPU 0 still has MIG instances"}])
    shown = api.get("/v1/nodes/nope").json()["gpus"][0]
    assert shown["mig_mode"] is True and shown["maintenance"]["state"] == "failed"
    _pod(api, "slice", mig="1g.10gb")
    schedule()
    assert _phase(api, "slice") == "Scheduled"


def test_a_busy_gpu_refuses_or_drains_first(
        api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Tick,
        clock: ManualClock) -> None:
    node = register_node("busy", gpus=_mig_gpus(2))
    _pod(api, "holder", gpus=1)
    schedule()
    held = api.get("/v1/pods/holder").json()
    [assignment] = api.get("/v1/agent/assignments", headers=agent_headers(node)).json()["pods"]
    index = next(g["index"] for g in api.get("/v1/nodes/busy").json()["gpus"]
                 if g["uuid"] in held["gpu_uuids"])
    refused = api.post("/v1/nodes/busy/gpu-actions", json={"action": "mig-on", "gpu": index})
    assert refused.status_code == 409 and "holder" in refused.json()["detail"], refused.text
    waiting = api.post("/v1/nodes/busy/gpu-actions",
                       json={"action": "mig-on", "gpu": index, "wait_seconds": 60})
    assert waiting.status_code == 200, waiting.text
    assert gpu_actions(api, node) == []  # not handed to the agent while the pod holds the GPU
    _pod(api, "second", gpus=1)
    _pod(api, "third", gpus=1)
    schedule()  # the other GPU takes one; nothing new on the draining one
    assert sorted(_phase(api, n) for n in ("second", "third")) == ["Pending", "Scheduled"]
    assert api.delete("/v1/pods/holder").status_code in (200, 202, 204)
    assert gpu_actions(api, node) == []  # still stopping: the pod holds the GPU
    _stopped(api, node, assignment)
    [action] = gpu_actions(api, node)
    assert action["gpu_index"] == index and action["action"] == "mig-on"

    other = 1 - index
    assert api.post("/v1/nodes/busy/gpu-actions",
                    json={"action": "mig-on", "gpu": other, "wait_seconds": 30}
                    ).status_code == 200
    clock.advance(31)
    renew_lease(api, node, gpu_health=[])
    failed = api.get("/v1/nodes/busy").json()["gpus"][other]["maintenance"]
    assert failed["state"] == "failed" and "pods still hold the GPU" in failed["output"]


def test_bad_mig_mode_requests(
        api: TestClient, register_node: Callable[..., dict[str, Any]]) -> None:
    register_node("plain", gpus=h100_gpus(1))  # not MIG-capable as reported
    register_node("migged", gpus=_mig_gpus(1, on=True))
    for ref, body, status in (
            ("plain", {"action": "mig-on", "gpu": 0}, 422),
            ("migged", {"action": "mig-on"}, 422),
            ("migged", {"action": "mig-on", "gpu": 0}, 409),  # already on
            ("migged", {"action": "mig-off", "gpu": 0, "wait_seconds": -1}, 422)):
        response = api.post(f"/v1/nodes/{ref}/gpu-actions", json=body)
        assert response.status_code == status, response.text
        if status == 422:
            assert response.json()["field"] in ("gpu", "wait_seconds"), response.text
