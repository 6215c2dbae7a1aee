"""The server's scheduling of MIG pods and memory-limited shares (both databases): MIG only
on GPUs whose reported MIG mode is on, a fixed policy uses the node's advertised layout
(never a new instance), shares' memory limits add up per GPU, MIG gang members are placed
all or nothing with their slots, and `node uncordon` ends a health-check cordon."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from gpucloud.controllers.loops import JobController
from gpucloud.core.clock import ManualClock
from gpucloud.services.context import ServiceContext
from tests.integration.conftest import agent_headers, h100_gpus

Tick = Callable[[], Any]


def _gpus(count: int, *, mig_mode: bool, prefix: str = "") -> list[dict[str, Any]]:
    gpus = h100_gpus(count)
    for gpu in gpus:
        gpu.update(mig_mode=mig_mode, mig_capable=True, uuid=f"{prefix}{gpu['uuid']}")
    return gpus


def _pod(api: TestClient, name: str, **spec: Any) -> None:
    response = api.post("/v1/pods", json={"name": name, "image": "busybox", **spec})
    assert response.status_code == 201, response.text


def _get(api: TestClient, name: str) -> dict[str, Any]:
    body: dict[str, Any] = api.get(f"/v1/pods/{name}").json()
    return body


def test_mig_pods_go_only_where_mig_mode_is_on(
        api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Tick) -> None:
    register_node("plain", gpus=_gpus(1, mig_mode=False, prefix="p"))
    _pod(api, "m0", mig="1g.10gb")
    schedule()
    assert _get(api, "m0")["phase"] == "Pending"
    why = api.get("/v1/pods/m0/why").json()["summary"]
    assert "MIG mode off on its GPUs" in why, why
    gpus = _gpus(1, mig_mode=True, prefix="m")
    register_node("migged", gpus=gpus)
    schedule()
    pod = _get(api, "m0")
    assert pod["phase"] == "Scheduled" and pod["node"] == "migged", pod
    assert pod["gpu_uuids"] == [gpus[0]["uuid"]] and pod["mig_slot"] is not None


def test_a_fixed_layout_gives_existing_instances_and_makes_none(
        api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Tick) -> None:
    gpus = _gpus(1, mig_mode=True, prefix="f")
    uuid = gpus[0]["uuid"]
    gpus[0]["mig_instances"] = [
        {"gpu_uuid": uuid, "mig_uuid": f"MIG-{i}", "profile": profile, "slot": slot}
        for i, (profile, slot) in enumerate((("3g.40gb", 4), ("1g.10gb", 0), ("1g.10gb", 1)))]
    register_node("fixed", gpus=gpus)
    assert api.post("/v1/nodes/fixed/mig", json={"mode": "fixed"}).status_code == 200
    for name, profile in (("a", "1g.10gb"), ("b", "1g.10gb"), ("c", "1g.10gb"),
                          ("three", "3g.40gb"), ("four", "4g.40gb")):
        _pod(api, name, mig=profile)
    schedule()
    pods = {name: _get(api, name) for name in ("a", "b", "c", "three", "four")}
    assert {n: p["mig_slot"] for n, p in pods.items() if p["phase"] == "Scheduled"} == {
        "a": 0, "b": 1, "three": 4}
    assert pods["c"]["phase"] == pods["four"]["phase"] == "Pending"
    assert "no free MIG slot for 4g.40gb" in api.get("/v1/pods/four/why").json()["summary"]


def test_share_memory_limits_add_up_per_gpu(
        api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Tick) -> None:
    register_node("shares", gpus=h100_gpus(1))
    _pod(api, "s1", gpus=0.25, gpu_memory="40Gi")
    _pod(api, "s2", gpus=0.25, gpu_memory="30Gi")
    schedule()
    assert [_get(api, n)["phase"] for n in ("s1", "s2")] == ["Scheduled", "Scheduled"]
    _pod(api, "s3", gpus=0.25, gpu_memory="20Gi")  # 80 GB card, 70 GiB promised
    _pod(api, "s4", gpus=0.25)  # no limit: promises no memory, fits the free share
    schedule()
    assert _get(api, "s3")["phase"] == "Pending"
    assert "no GPU with enough free share" in api.get("/v1/pods/s3/why").json()["summary"]
    assert _get(api, "s4")["phase"] == "Scheduled"


def test_mig_gang_members_are_placed_all_or_nothing_with_their_slots(
        api: TestClient, register_node: Callable[..., dict[str, Any]],
        app_ctx: ServiceContext, clock: ManualClock) -> None:
    jobs = JobController(app_ctx).tick
    register_node("ga", gpus=_gpus(1, mig_mode=True, prefix="a"))
    register_node("gb", gpus=_gpus(1, mig_mode=False, prefix="b"))
    body = {"image": "busybox", "nodes": 2, "mig": "3g.40gb"}
    assert api.post("/v1/jobs", json={"name": "pair", **body}).status_code == 201
    jobs()
    members = [_get(api, f"pair-{i}") for i in range(2)]
    assert [m["phase"] for m in members] == ["Pending", "Pending"]  # not one of them alone
    why = api.get("/v1/jobs/pair/why").json()["summary"]
    assert "needs 2 nodes with a free 3g.40gb MIG slot each, 1 has them" in why, why
    register_node("gc", gpus=_gpus(1, mig_mode=True, prefix="c"))
    clock.advance(120)  # past the unschedulable back-off
    jobs()
    members = [_get(api, f"pair-{i}") for i in range(2)]
    assert [m["phase"] for m in members] == ["Scheduled", "Scheduled"], members
    assert sorted(m["node"] for m in members) == ["ga", "gc"]
    assert all(m["mig_slot"] in (0, 4) and m["mig"] == "3g.40gb" for m in members)


def test_uncordon_ends_a_health_check_cordon(
        api: TestClient, register_node: Callable[..., dict[str, Any]]) -> None:
    node = register_node("sick", gpus=h100_gpus(1))
    lease = api.post("/v1/agent/lease", headers=agent_headers(node),
                     json={"fencing_token": node["fencing_token"],
                           "node_fault": "GPU0: XID 79 (node)", "auto_uncordon": False})
    assert lease.status_code == 200, lease.text
    shown = api.get("/v1/nodes/sick").json()
    assert shown["cordoned"] and shown["cordon_reason"] == "GPU0: XID 79 (node)"
    shown = api.post("/v1/nodes/sick/uncordon").json()
    assert not shown["cordoned"] and shown["cordon_reason"] is None
    assert api.get("/v1/nodes/sick").json()["cordon_reason"] is None
