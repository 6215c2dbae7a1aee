"""GPU health through the lease: a failed GPU out of scheduling, a node-level fault
cordons the node with its reason, and the node is uncordoned when the checks pass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from tests.integration.conftest import h100_gpus, renew_lease


def _health(gpus: list[dict[str, Any]], bad: int | None) -> list[dict[str, Any]]:
    return [{"uuid": g["uuid"], "healthy": i != bad,
             "reason": "GPU0: XID 48 (gpu-reset)" if i == bad else None}
            for i, g in enumerate(gpus)]


def test_a_failed_gpu_is_out_of_scheduling_and_the_node_serves_the_others(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    gpus = h100_gpus(2)
    node = register_node("one", gpus=gpus)
    renew_lease(api, node, gpu_health=_health(gpus, 0))
    shown = api.get("/v1/nodes/one").json()
    assert [g["healthy"] for g in shown["gpus"]] == [False, True]
    assert not shown["cordoned"]
    api.post("/v1/pods", json={"name": "p1", "image": "busybox", "gpus": 1})
    api.post("/v1/pods", json={"name": "p2", "image": "busybox", "gpus": 1})
    schedule()
    pods = {p["name"]: p for p in api.get("/v1/pods").json()}
    placed = [p for p in pods.values() if p["phase"] == "Scheduled"]
    assert len(placed) == 1 and placed[0]["gpu_uuids"] == [gpus[1]["uuid"]]


def test_a_node_fault_cordons_with_the_reason_and_clears_when_checks_pass(
    api: TestClient, register_node: Callable[..., dict[str, Any]]
) -> None:
    node = register_node("two", gpus=h100_gpus(1))
    renew_lease(api, node, node_fault="GPU0: XID 79 (node)")
    shown = api.get("/v1/nodes/two").json()
    assert shown["cordoned"] and shown["cordon_reason"] == "GPU0: XID 79 (node)"
    renew_lease(api, node, node_fault=None, auto_uncordon=False)
    assert api.get("/v1/nodes/two").json()["cordoned"]
    renew_lease(api, node, node_fault=None)
    shown = api.get("/v1/nodes/two").json()
    assert not shown["cordoned"] and shown["cordon_reason"] is None
