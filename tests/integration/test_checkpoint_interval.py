"""δ, M and τ on the server: from recorded checkpoint costs and the pod event history
(running time, unannounced node losses) per priority class and node pool; on `pod get`
and on the assignment. And `--checkpoint transparent` refused where no node can serve it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import insert

from gpucloud.core.checkpoint_interval import daly_interval
from gpucloud.core.clock import ManualClock
from gpucloud.db.models import CheckpointModel, PodModel
from gpucloud.services.context import ServiceContext, new_id
from tests.integration.conftest import agent_headers

DAY = 86400.0
POD = {"name": "train", "image": "busybox", "command": ["sleep", "60"],
       "checkpoint_dir": "/ckpt", "restart": "always"}


def _status(api: TestClient, reg: dict[str, Any], pod_id: str, phase: str) -> None:
    response = api.post(f"/v1/agent/pods/{pod_id}/status", headers=agent_headers(reg),
                        json={"fencing_token": reg["fencing_token"], "phase": phase})
    assert response.status_code == 200, response.text


def _pod(api: TestClient, app_ctx: ServiceContext, name: str = "train") -> dict[str, Any]:
    app_ctx.cache.clear()  # the interruption statistics are cached for a few seconds
    body: dict[str, Any] = api.get(f"/v1/pods/{name}").json()
    return body


def _assignment(api: TestClient, reg: dict[str, Any], pod_id: str) -> dict[str, Any]:
    pods = api.get("/v1/agent/assignments", headers=agent_headers(reg)).json()["pods"]
    return next(p for p in pods if p["pod_id"] == pod_id)


def test_m_counts_running_time_and_node_losses_and_tau_follows_daly(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], expire_leases: Callable[[], list[str]], clock: ManualClock,
) -> None:
    reg1 = register_node("cpu-1", gpus=[], labels={"pool": "spot-a"})
    pod = api.post("/v1/pods", json=POD).json()
    fresh = _pod(api, app_ctx)
    assert fresh["checkpoint_cost_seconds"] == 60.0  # the documented default δ
    assert fresh["interruption_mtbf_seconds"] == DAY  # the prior M0
    assert fresh["checkpoint_interval_seconds"] == pytest.approx(daly_interval(60, DAY), 1e-3)
    schedule()
    _status(api, reg1, pod["id"], "Running")
    clock.advance(3 * 3600)
    running = _pod(api, app_ctx)
    assert running["interruption_mtbf_seconds"] == pytest.approx(3 * 3600 + DAY)
    reg2 = register_node("cpu-2", gpus=[], labels={"pool": "spot-a"})
    clock.advance(app_ctx.settings.lease_ttl_seconds + 1)
    api.post("/v1/agent/lease", headers=agent_headers(reg2), json={"fencing_token": 1})
    assert expire_leases() == ["cpu-1"]
    # One unannounced interruption in 3 h + TTL of running time, plus the prior.
    exposure = 3 * 3600 + app_ctx.settings.lease_ttl_seconds + 1
    schedule()  # M is its pool's: the node it is bound to (cpu-2, also pool spot-a)
    lost = _pod(api, app_ctx)
    assert lost["node"] == "cpu-2"
    assert lost["interruption_mtbf_seconds"] == pytest.approx((exposure + DAY) / 2)
    assignment = _assignment(api, reg2, pod["id"])
    assert assignment["checkpoint_signal"] == "SIGUSR1"
    assert assignment["checkpoint_interval_seconds"] == pytest.approx(
        daly_interval(60, (exposure + DAY) / 2), 1e-6)


def test_other_pools_and_classes_keep_their_own_m(
    api: TestClient, app_ctx: ServiceContext, register_node: Callable[..., dict[str, Any]],
    schedule: Callable[[], Any], expire_leases: Callable[[], list[str]], clock: ManualClock,
) -> None:
    reg1 = register_node("cpu-1", gpus=[], labels={"pool": "flaky"})
    pod = api.post("/v1/pods", json=POD).json()
    schedule()
    _status(api, reg1, pod["id"], "Running")
    clock.advance(app_ctx.settings.lease_ttl_seconds + 1)
    register_node("cpu-2", gpus=[])  # pool "default"
    assert expire_leases() == ["cpu-1"]
    schedule()
    moved = _pod(api, app_ctx)
    assert moved["node"] == "cpu-2"
    assert moved["interruption_mtbf_seconds"] == DAY  # nothing lost in pool "default"


def test_delta_is_the_median_of_the_last_measured_costs(
    api: TestClient, app_ctx: ServiceContext, clock: ManualClock,
) -> None:
    pod = api.post("/v1/pods", json={**POD, "checkpoint_signal": "usr2"}).json()
    with app_ctx.db.transaction() as session:
        project_id = session.get_one(PodModel, pod["id"]).project_id
        for seq, cost in enumerate([900.0, 10.0, 12.0, 500.0, 11.0, 13.0]):
            clock.advance(1)
            session.execute(insert(CheckpointModel.__table__).values(_committed_row(
                id=new_id(), project_id=project_id, key=pod["id"], pod_id=pod["id"],
                attempt=0, seq=seq, manifest=f"m{seq}", state="committed",
                cost_seconds=cost, created_at=clock.now())))
    shown = _pod(api, app_ctx)
    assert shown["checkpoint_signal"] == "SIGUSR2"
    assert shown["checkpoint_cost_seconds"] == 12.0  # median of 10, 12, 500, 11, 13
    assert shown["checkpoint_interval_seconds"] == pytest.approx(
        max(60.0, daly_interval(12.0, DAY)), 1e-3)


def _committed_row(**values: Any) -> dict[str, Any]:
    """A checkpoint row as the checkpoints service commits it: what this test sets, and a
    neutral value for every other required column (their schema is theirs)."""
    for column in CheckpointModel.__table__.columns:
        if column.name in values or column.nullable or column.default is not None:
            continue
        python_type = column.type.python_type
        values[column.name] = {list: [], dict: {}, int: 0, str: ""}.get(python_type, 0)
    return values


def test_pods_without_checkpoints_get_no_interval(api: TestClient, app_ctx: ServiceContext,
                                                  ) -> None:
    plain = {k: v for k, v in POD.items() if k != "checkpoint_dir"}
    api.post("/v1/pods", json=plain)
    shown = _pod(api, app_ctx)
    assert shown["checkpoint_interval_seconds"] is None


@pytest.mark.parametrize(("field", "value", "words"), [
    ("checkpoint_signal", "SIGKILL", "not one of"),
    ("checkpoint", "magic", "not one of"),
    ("checkpoint_dir", "ckpt", "absolute"),
])
def test_bad_checkpoint_fields_are_422_naming_the_field(api: TestClient, field: str,
                                                        value: str, words: str) -> None:
    response = api.post("/v1/pods", json={**POD, field: value})
    assert response.status_code == 422
    assert response.json()["field"] == field and words in response.json()["detail"]


def test_transparent_is_refused_naming_the_node_capability(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any],
) -> None:
    register_node("plain", gpus=[], capabilities={
        "criu": False, "criu_reason": "criu check failed: vdso: Unexpected rt vDSO area"})
    transparent = {**POD, "checkpoint": "transparent", "checkpoint_dir": None}
    refused = api.post("/v1/pods", json=transparent)
    assert refused.status_code == 422 and refused.json()["field"] == "checkpoint"
    assert "node capability criu is false" in refused.json()["detail"]
    assert "plain: criu check failed: vdso" in refused.json()["detail"]
    able = register_node("able", gpus=[], capabilities={"criu": True,
                                                         "criu_version": "4.1"})
    assert api.get("/v1/nodes/able").json()["capabilities"]["criu"] is True
    for body in ({**transparent, "gpus": 0.5}, {**transparent, "gpus": 1}):
        gpu = api.post("/v1/pods", json=body)
        assert gpu.status_code == 422 and "GPU" in gpu.json()["detail"]
    job = api.post("/v1/jobs", json={"name": "gang", "image": "busybox", "nodes": 2,
                                     "checkpoint": "transparent"})
    assert job.status_code == 422 and "multi-node" in job.json()["detail"]
    one = api.post("/v1/jobs", json={"name": "solo", "image": "busybox", "nodes": 1,
                                     "checkpoint": "transparent"})
    assert one.status_code == 422 and "barrier" in one.json()["detail"]
    both = api.post("/v1/pods", json={**transparent, "checkpoint_dir": "/ckpt"})
    assert both.status_code == 422 and both.json()["field"] == "checkpoint_dir"
    for index in range(3):
        created = api.post("/v1/pods", json={**transparent, "name": f"t{index}"})
        assert created.status_code == 201, created.text
    schedule()
    assert {api.get(f"/v1/pods/t{i}").json()["node"] for i in range(3)} == {"able"}
    # The agent is told to dump it and where its dumps are filed (no directory to mount).
    pods = api.get("/v1/agent/assignments", headers=agent_headers(able)).json()["pods"]
    assert [(p["checkpoint_mode"], p["checkpoint_dir"], p["checkpoint_key"],
             p["restore_checkpoint"]) for p in pods] == [
        ("transparent", None, p["pod_id"], None) for p in pods] and len(pods) == 3


def test_a_gpu_pod_is_transparent_only_where_cuda_checkpoint_is(
    api: TestClient, register_node: Callable[..., dict[str, Any]], schedule: Callable[[], Any],
) -> None:
    """Whole GPUs need criu and cuda-checkpoint on the node; such a pod goes only there."""
    register_node("criu-only", capabilities={"criu": True})
    transparent = {**POD, "checkpoint": "transparent", "checkpoint_dir": None, "gpus": 1}
    refused = api.post("/v1/pods", json=transparent)
    assert refused.status_code == 422 and refused.json()["field"] == "checkpoint"
    assert "criu-only: cuda-checkpoint is not installed" in refused.json()["detail"]
    register_node("cuda", capabilities={"criu": True, "cuda_checkpoint": True})
    for index in range(3):
        created = api.post("/v1/pods", json={**transparent, "name": f"g{index}"})
        assert created.status_code == 201, created.text
    cpu = api.post("/v1/pods", json={**transparent, "name": "cpu", "gpus": 0})
    assert cpu.status_code == 201, cpu.text
    schedule()
    assert {api.get(f"/v1/pods/g{i}").json()["node"] for i in range(3)} == {"cuda"}
    assert api.get("/v1/pods/cpu").json()["node"] in {"criu-only", "cuda"}
    share = api.post("/v1/pods", json={**transparent, "name": "half", "gpus": 0.5})
    assert share.status_code == 422 and "share of a GPU" in share.json()["detail"]
    mig = api.post("/v1/pods", json={**transparent, "name": "slice", "mig": "1g.10gb",
                                     "gpu_type": "H100-80GB"})
    assert mig.status_code == 422 and "MIG" in mig.json()["detail"], mig.text
