"""Preemption for MIG and memory-limited preemptors (both databases): victims are chosen by
the MIG slices and the device memory the preemptor needs, not as if it asked for a whole
GPU, and a MIG preemptor binds onto its reservation at the slot the victims freed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from gpucloud.core.clock import ManualClock
from tests.integration.conftest import agent_headers, h100_gpus

Register = Callable[..., dict[str, Any]]
Tick = Callable[[], Any]


def _create(api: TestClient, name: str, cls: str, **spec: Any) -> None:
    body = {"name": name, "image": "busybox", "priority_class": cls, **spec}
    response = api.post("/v1/pods", json=body)
    assert response.status_code == 201, response.text


def _agent_step(api: TestClient, reg: dict[str, Any]) -> None:
    """What the agent does: start what is assigned, stop what is to be stopped."""
    pods = api.get("/v1/agent/assignments", headers=agent_headers(reg)).json()["pods"]
    for pod in pods:
        phase = {"stopped": "Stopped"}.get(pod["desired_state"],
                                           "Running" if pod["phase"] == "Scheduled" else None)
        if phase is None:
            continue
        response = api.post(f"/v1/agent/pods/{pod['pod_id']}/status",
                            headers=agent_headers(reg),
                            json={"fencing_token": reg["fencing_token"], "phase": phase,
                                  "attempt": pod["attempt"]})
        assert response.status_code == 200, response.text


def _pods(api: TestClient) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in api.get("/v1/pods").json()}


def test_a_mig_preemptor_stops_only_the_slices_it_needs(
        api: TestClient, register_node: Register, schedule: Tick, clock: ManualClock) -> None:
    gpus = h100_gpus(1)
    gpus[0].update(mig_capable=True, mig_mode=True)
    node = register_node("mig", gpus=gpus)
    for i in range(7):
        _create(api, f"s{i}", "spot", mig="1g.10gb")
    schedule()
    _agent_step(api, node)
    slots = {p["mig_slot"]: name for name, p in _pods(api).items()}
    assert sorted(slots) == list(range(7))
    _create(api, "big", "on-demand", mig="3g.40gb")
    schedule()
    why = api.get("/v1/pods/big/why").json()["summary"]
    assert "preempting 3 pods" in why, why  # slices 4-7, not the whole GPU
    stopping = {n for n, p in _pods(api).items() if p["desired_state"] == "stopped"}
    assert stopping == {slots[4], slots[5], slots[6]}
    _agent_step(api, node)
    clock.advance(1)
    schedule()
    big = _pods(api)["big"]
    assert big["phase"] == "Scheduled" and big["mig_slot"] == 4, big
    assert sum(p["phase"] == "Running" for p in _pods(api).values()) == 4


def test_a_memory_limited_preemptor_frees_enough_device_memory(
        api: TestClient, register_node: Register, schedule: Tick, clock: ManualClock) -> None:
    node = register_node("share", gpus=h100_gpus(1))
    for name in ("a", "b"):
        _create(api, name, "spot", gpus=0.25, gpu_memory="30Gi")
    schedule()
    _agent_step(api, node)
    _create(api, "wide", "on-demand", gpus=0.25, gpu_memory="50Gi")  # 30 + 50 GiB > 80 GB
    schedule()
    why = api.get("/v1/pods/wide/why").json()["summary"]
    assert "preempting 2 pods" in why, why
    _agent_step(api, node)
    clock.advance(1)
    schedule()
    assert _pods(api)["wide"]["phase"] == "Scheduled"
