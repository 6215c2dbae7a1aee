"""`node gpu-reset` / `node diag` through the REST API and the agent protocol (both
databases): the request rides in the node's assignments, the agent's result in its lease
renewal; a passed one puts the GPU back in service, a failed one keeps it out; a reset of
a GPU pods hold is refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from tests.integration.conftest import gpu_actions, h100_gpus, renew_lease

Tick = Callable[[], Any]


def _sick(api: TestClient, node: dict[str, Any], gpus: list[dict[str, Any]],
          bad: int) -> None:
    renew_lease(api, node, gpu_health=[{"uuid": g["uuid"], "healthy": i != bad,
                                   "reason": "GPU1: XID 48 (gpu-reset)" if i == bad else None}
                                  for i, g in enumerate(gpus)])


def test_reset_passes_and_the_gpu_is_back_in_service(
        api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Tick) -> None:
    gpus = h100_gpus(2)
    node = register_node("maint", gpus=gpus)
    _sick(api, node, gpus, 1)
    asked = api.post("/v1/nodes/maint/gpu-actions", json={"action": "reset", "gpu": 1,
                                                          "level": 2})
    assert asked.status_code == 200, asked.text
    maintenance = asked.json()["gpus"][1]["maintenance"]
    assert maintenance["state"] == "requested" and asked.json()["gpus"][0]["maintenance"] is None
    [action] = gpu_actions(api, node)
    assert action == {"id": maintenance["id"], "gpu_uuid": gpus[1]["uuid"], "gpu_index": 1,
                      "action": "reset", "level": 2}
    renew_lease(api, node, gpu_actions=[{"id": action["id"], "passed": True, "output": "Pass"}])
    shown = api.get("/v1/nodes/maint").json()["gpus"][1]
    assert shown["healthy"] and shown["maintenance"]["state"] == "passed"
    assert shown["maintenance"]["output"] == "Pass" and gpu_actions(api, node) == []
    renew_lease(api, node, gpu_actions=[{"id": action["id"], "passed": False}])  # a stale repeat
    assert api.get("/v1/nodes/maint").json()["gpus"][1]["maintenance"]["state"] == "passed"
    for name in ("a", "b"):
        api.post("/v1/pods", json={"name": name, "image": "busybox", "gpus": 1})
    schedule()
    assert {api.get(f"/v1/pods/{n}").json()["phase"] for n in ("a", "b")} == {"Scheduled"}


def test_a_failed_diag_keeps_the_gpu_out_and_diag_of_all_gpus(
        api: TestClient, register_node: Callable[..., dict[str, Any]]) -> None:
    gpus = h100_gpus(2)
    node = register_node("diag", gpus=gpus)
    _sick(api, node, gpus, 1)
    assert api.post("/v1/nodes/diag/gpu-actions", json={"action": "diag"}).status_code == 200
    actions = gpu_actions(api, node)
    assert [a["gpu_index"] for a in actions] == [0, 1]
    renew_lease(api, node, gpu_actions=[{"id": actions[0]["id"], "passed": True},
                                   {"id": actions[1]["id"], "passed": False,
                                    "output": "GPU Memory: Fail"}])
    shown = api.get("/v1/nodes/diag").json()["gpus"]
    assert [g["maintenance"]["state"] for g in shown] == ["passed", "failed"]
    assert [g["healthy"] for g in shown] == [True, False]


def test_bad_requests_and_a_busy_gpu(
        api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Tick) -> None:
    register_node("busy", gpus=h100_gpus(1))
    api.post("/v1/pods", json={"name": "holder", "image": "busybox", "gpus": 1})
    schedule()
    busy = api.post("/v1/nodes/busy/gpu-actions", json={"action": "reset", "gpu": 0})
    assert busy.status_code == 409 and "holder" in busy.json()["detail"], busy.text
    for body, field in (({"action": "reset"}, "gpu"), ({"action": "diag", "gpu": 5}, "gpu"),
                        ({"action": "reboot", "gpu": 0}, "action"),
                        ({"action": "diag", "level": 9}, "level")):
        response = api.post("/v1/nodes/busy/gpu-actions", json=body)
        assert response.status_code == 422 and response.json()["field"] == field, response.text
    assert api.post("/v1/nodes/nowhere/gpu-actions",
                    json={"action": "diag"}).status_code == 404
