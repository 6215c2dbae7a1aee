"""Load-aware placement end to end: samples posted through the agent usage route move a
new pod away from the node whose real load is high; and ``/metrics`` shows the server's
requests, passes, pending pods, nodes and leases."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gpucloud.controllers.loops import SchedulingController
from gpucloud.core.clock import ManualClock
from gpucloud.scheduler import Scheduler
from gpucloud.services.context import ServiceContext
from gpucloud.services.metrics import families
from tests.integration.conftest import agent_headers

GIB = 1024**3


def _pod(api: TestClient, name: str, cpu: float = 2) -> str:
    response = api.post("/v1/pods", json={"name": name, "image": "busybox",
                                          "command": ["sleep", "600"], "gpus": 0,
                                          "cpu": cpu, "memory": "2Gi"})
    assert response.status_code in (200, 201), response.text
    return str(response.json()["id"])


def _node_of(api: TestClient, pod_id: str) -> str:
    return str(api.get(f"/v1/pods/{pod_id}").json()["node"])


def _attempt(api: TestClient, reg: dict[str, Any], pod_id: str) -> int:
    """The pod's attempt, as its node's agent is told in its assignments."""
    body = api.get("/v1/agent/assignments", headers=agent_headers(reg)).json()
    return next(int(a["attempt"]) for a in body["pods"] if a["pod_id"] == pod_id)


def _samples(api: TestClient, reg: dict[str, Any], pod_id: str, cores: float,
             clock: ManualClock) -> None:
    """Three samples, 10 s apart, ending now: ``cores`` of CPU, 1 GiB of memory."""
    now = clock.now()
    attempt = _attempt(api, reg, pod_id)
    samples = [{"pod_id": pod_id, "attempt": attempt, "seq": i,
                "time": (now - timedelta(seconds=20 - 10 * i)).isoformat(),
                "cpu_seconds": 100 + cores * 10 * i, "memory_bytes": GIB,
                "memory_peak_bytes": GIB} for i in range(3)]
    response = api.post("/v1/agent/usage", headers=agent_headers(reg),
                        json={"fencing_token": reg["fencing_token"], "samples": samples})
    assert response.status_code == 200, response.text


def _place_two(api: TestClient, register_node: Callable[..., dict[str, Any]],
               schedule: Callable[[], Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Two equal nodes, one pod with the same requests on each (the other node cordoned
    while each is placed)."""
    regs = {name: register_node(name, gpus=[], cpu=16, memory=64 * GIB)
            for name in ("node-a", "node-b")}
    pods = []
    for name, other in (("node-a", "node-b"), ("node-b", "node-a")):
        assert api.post(f"/v1/nodes/{other}/cordon").status_code == 200
        pods.append(_pod(api, f"on-{name}"))
        schedule()
        assert _node_of(api, pods[-1]) == name
        assert api.post(f"/v1/nodes/{other}/uncordon").status_code == 200
    return regs, pods


@pytest.mark.parametrize(("profile", "moves"), [("default+load-aware", True),
                                                ("default", False)])
def test_load_aware_score_moves_a_new_pod_off_the_hot_node(
        api: TestClient, app_ctx: ServiceContext, clock: ManualClock,
        register_node: Callable[..., dict[str, Any]], profile: str, moves: bool) -> None:
    controller = SchedulingController(app_ctx, Scheduler(profile))
    regs, (on_a, on_b) = _place_two(api, register_node, controller.tick)
    # Same requests on both nodes; node-a's pod really uses 13 of its 16 cores.
    _samples(api, regs["node-a"], on_a, 13.0, clock)
    _samples(api, regs["node-b"], on_b, 0.5, clock)
    third = _pod(api, "third")
    controller.tick()
    # Requests alone cannot tell the nodes apart: the default profile takes the first
    # node whatever its real load; the load-aware one moves the pod off it.
    assert _node_of(api, third) == ("node-b" if moves else "node-a")


def test_stale_samples_fail_open(
        api: TestClient, app_ctx: ServiceContext, clock: ManualClock,
        register_node: Callable[..., dict[str, Any]]) -> None:
    """Samples older than the load window do not keep a node off (fail-open)."""
    controller = SchedulingController(app_ctx, Scheduler("default+load-aware-filter"))
    regs, pods = _place_two(api, register_node, controller.tick)
    node = "node-a"
    _samples(api, regs[node], pods[0], 15.5, clock)
    blocked = _pod(api, "blocked", cpu=1)
    # Too hot for the 65 % CPU filter: the new pod goes to the other node.
    controller.tick()
    assert _node_of(api, blocked) != node
    clock.advance(400)
    later = [_pod(api, f"later-{i}", cpu=1) for i in range(6)]
    controller.tick()
    assert node in {_node_of(api, p) for p in later}


def test_metrics_exposition(api: TestClient, app_ctx: ServiceContext,
                            register_node: Callable[..., dict[str, Any]],
                            schedule: Callable[[], Any],
                            expire_leases: Callable[[], list[str]],
                            clock: ManualClock) -> None:
    reg = register_node("node-m", gpus=[], cpu=4, memory=8 * GIB)
    api.post("/v1/agent/lease", headers=agent_headers(reg),
             json={"fencing_token": reg["fencing_token"]})
    _pod(api, "fits", cpu=1)
    _pod(api, "too-big", cpu=64)
    schedule()
    api.get("/v1/pods/does-not-exist")
    response = api.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = list(families(response.text))

    def value(name: str, **labels: str) -> float:
        found = [v for n, ls, v in samples if n == name and labels.items() <= ls.items()]
        assert found, f"{name} {labels} not in /metrics: {[s for s in samples if s[0] == name]}"
        return sum(found)

    assert value("gpucloud_http_requests_total", route="/v1/pods", method="POST",
                 code="201") >= 2
    assert value("gpucloud_http_requests_total", route="/v1/pods/{ref}",
                 code="404") >= 1
    assert value("gpucloud_http_request_duration_seconds_count", route="/v1/pods") >= 2
    assert value("gpucloud_scheduler_pass_duration_seconds_count") >= 1
    assert value("gpucloud_scheduler_pods_total", outcome="unschedulable") >= 1
    assert value("gpucloud_pending_pods", reason="Unschedulable") == 1
    assert value("gpucloud_pods", phase="Scheduled") == 1
    assert value("gpucloud_nodes", state="Ready") == 1
    assert value("gpucloud_node_lease_renewals_total") >= 1
    before = value("gpucloud_node_lease_expiries_total")
    clock.advance(3600)
    assert expire_leases() == ["node-m"]
    after = list(families(api.get("/metrics").text))
    samples = after
    assert value("gpucloud_node_lease_expiries_total") == before + 1
    assert value("gpucloud_nodes", state="Lost") == 1
    assert not any(n.startswith("DCGM_") for n, _, _ in samples)
