"""The scheduling loop against a real database: placement, explanations, guarded apply."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from gpucloud.services import scheduling
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import h100_gpus


def _pod(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "image": "busybox", "command": ["true"], **fields}


def test_best_fit_fills_the_fuller_node_and_gpus_never_overlap(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    register_node("a")
    register_node("b")
    api.post("/v1/pods", json=_pod("six", gpus=6))
    schedule()
    first = api.get("/v1/pods/six").json()["node"]
    api.post("/v1/pods", json=_pod("two", gpus=2))
    schedule()
    assert api.get("/v1/pods/two").json()["node"] == first
    uuids = [u for p in api.get("/v1/pods").json() for u in p["gpu_uuids"]]
    assert len(uuids) == len(set(uuids)) == 8


def test_unschedulable_pod_stays_pending_and_why_counts_reasons(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    for name in ("a", "b", "c"):
        register_node(name)
    register_node("d")
    api.post("/v1/nodes/d/cordon")
    for name in ("a", "b", "c"):
        api.post("/v1/pods", json=_pod(f"fill-{name}", gpus=8))
    schedule()
    api.post("/v1/pods", json=_pod("big", gpus=4))
    schedule()
    assert api.get("/v1/pods/big").json()["phase"] == "Pending"
    why = api.get("/v1/pods/big/why").json()
    assert why["reasons"] == {"not enough free GPUs": 3, "cordoned": 1}
    assert why["summary"] == "3 nodes: not enough free GPUs; 1 node: cordoned"
    events = api.get("/v1/pods/big/events").json()
    assert events[-1]["reason"] == "FailedScheduling"
    schedule()
    assert len(api.get("/v1/pods/big/events").json()) == len(events)
    api.post("/v1/nodes/d/uncordon")
    schedule()
    assert api.get("/v1/pods/big").json()["node"] == "d"


def test_model_cpu_and_memory_filters(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    register_node("h100", cpu=16, memory=64 * 1024**3)
    l40 = [{"uuid": f"GPU-l40s-{i}", "model": "L40S", "memory_mib": 46068} for i in range(4)]
    register_node("l40s", gpus=l40, cpu=16, memory=64 * 1024**3)
    api.post("/v1/pods", json=_pod("want-l40s", gpus=1, gpu_type="l40s"))
    api.post("/v1/pods", json=_pod("too-much-cpu", gpus=1, cpu=32))
    api.post("/v1/pods", json=_pod("too-much-memory", gpus=1, memory="128Gi"))
    api.post("/v1/pods", json=_pod("want-a100", gpus=1, gpu_type="A100-80GB"))
    schedule()
    assert api.get("/v1/pods/want-l40s").json()["node"] == "l40s"
    assert api.get("/v1/pods/too-much-cpu/why").json()["reasons"] == {"not enough CPU": 2}
    assert api.get("/v1/pods/too-much-memory/why").json()["reasons"] == {
        "not enough memory": 2}
    reasons = api.get("/v1/pods/want-a100/why").json()["reasons"]
    assert sum(reasons.values()) == 2 and all("A100-80GB" in r for r in reasons)


def test_fractional_gpus_share_one_gpu(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    register_node("small", gpus=h100_gpus(1))
    api.post("/v1/pods", json=_pod("half-a", gpus=0.5))
    api.post("/v1/pods", json=_pod("half-b", gpus=0.5))
    api.post("/v1/pods", json=_pod("half-c", gpus=0.5))
    schedule()
    phases = {p["name"]: p["phase"] for p in api.get("/v1/pods").json()}
    assert phases == {"half-a": "Scheduled", "half-b": "Scheduled", "half-c": "Pending"}


def test_a_pod_deleted_between_lease_and_apply_is_not_bound(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
) -> None:
    register_node("a")
    pod = api.post("/v1/pods", json=_pod("racer", gpus=1)).json()
    token, leased = scheduling.lease_pending(app_ctx, 10)
    assert [p.id for p in leased] == [pod["id"]]
    snap = scheduling.snapshot(app_ctx)
    controller_scheduler = scheduling.Scheduler("default")
    [decision] = controller_scheduler.schedule(snap.nodes, [scheduling.pod_request(leased[0])])
    api.delete("/v1/pods/racer")
    versions = {name: node.version for name, node in snap.by_name.items()}
    assert not scheduling._bind(app_ctx, leased[0], token, decision, snap.by_name, versions)
    assert api.get("/v1/nodes/a").json()["gpus_allocated"] == 0


def test_a_node_cordoned_after_the_snapshot_refuses_the_bind(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
) -> None:
    register_node("a")
    api.post("/v1/pods", json=_pod("racer", gpus=1))
    token, leased = scheduling.lease_pending(app_ctx, 10)
    snap = scheduling.snapshot(app_ctx)
    [decision] = scheduling.Scheduler("default").schedule(
        snap.nodes, [scheduling.pod_request(leased[0])])
    api.post("/v1/nodes/a/cordon")
    versions = {name: node.version for name, node in snap.by_name.items()}
    assert not scheduling._bind(app_ctx, leased[0], token, decision, snap.by_name, versions)
    assert api.get("/v1/pods/racer").json()["phase"] == "Pending"
    assert scheduling.lease_pending(app_ctx, 10)[1] != []


def test_a_restarted_pod_is_placed_at_once_not_after_the_unschedulable_wait(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any]
) -> None:
    api.post("/v1/pods", json=_pod("early", gpus=1))
    schedule()
    assert api.get("/v1/pods/early/why").json()["reasons"] == {}
    api.post("/v1/pods/early/stop")
    register_node("a")
    api.post("/v1/pods/early/start")
    schedule()
    assert api.get("/v1/pods/early").json()["node"] == "a"
