"""The pod's network on the server: stored from the agent's Running report, shown as
``ip`` and ``ports_runtime`` (RunPod's ``runtime.ports``), cleared when the pod is requeued."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from tests.integration.conftest import agent_headers

POD = {"name": "web", "image": "busybox", "command": ["httpd"], "ports": ["8000/tcp"],
       "restart": "on-failure"}
NETWORK: dict[str, Any] = {"ip": "10.128.0.2", "host_network": False, "ports": [
    {"ip": "10.128.0.2", "isIpPublic": False, "privatePort": 8000, "type": "tcp"},
    {"ip": "127.0.0.2", "isIpPublic": True, "privatePort": 8000, "publicPort": 40017,
     "type": "tcp"}]}


def _status(api: TestClient, reg: dict[str, Any], pod_id: str, phase: str,
            **extra: Any) -> int:
    response = api.post(f"/v1/agent/pods/{pod_id}/status", headers=agent_headers(reg),
                        json={"fencing_token": reg["fencing_token"], "phase": phase, **extra})
    return int(response.status_code)


def test_the_running_report_sets_ip_and_ports_and_a_requeue_clears_them(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    reg = register_node("gpu-1")
    pod = api.post("/v1/pods", json=POD).json()
    assert pod["ip"] is None and pod["ports_runtime"] == []
    schedule()
    assert _status(api, reg, pod["id"], "Running", network=NETWORK) == 200
    got = api.get("/v1/pods/web").json()
    assert got["ip"] == "10.128.0.2"
    assert got["ports_runtime"] == [{**p, "publicPort": p.get("publicPort")}
                                    for p in NETWORK["ports"]]
    assert _status(api, reg, pod["id"], "Failed", exit_code=1) == 200
    requeued = api.get("/v1/pods/web").json()
    assert requeued["phase"] == "Pending" and requeued["ip"] is None
    assert requeued["ports_runtime"] == []


def test_a_malformed_network_report_is_refused(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    reg = register_node("gpu-1")
    pod = api.post("/v1/pods", json=POD).json()
    schedule()
    bad = {"ip": "10.128.0.2", "ports": [{"ip": "10.128.0.2", "privatePort": 8000}]}
    assert _status(api, reg, pod["id"], "Running", network=bad) == 422
    assert api.get("/v1/pods/web").json()["ip"] is None
