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


def _mig_node_running_spot_slices(api: TestClient, register_node: Register, schedule: Tick,
                                  count: int) -> dict[str, Any]:
    """One H100 in MIG mode with ``count`` spot 1g.10gb pods placed and running on it."""
    gpus = h100_gpus(1)
    gpus[0].update(mig_capable=True, mig_mode=True)
    node = register_node("mig", gpus=gpus)
    for i in range(count):
        _create(api, f"s{i}", "spot", mig="1g.10gb")
    schedule()
    _agent_step(api, node)
    return node


def test_a_mig_preemptor_stops_only_the_slices_it_needs(
        api: TestClient, register_node: Register, schedule: Tick, clock: ManualClock) -> None:
    node = _mig_node_running_spot_slices(api, register_node, schedule, 7)
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


def test_a_mig_preemptors_reserved_slot_is_taken_for_other_mig_pods(
        api: TestClient, register_node: Register, schedule: Tick, clock: ManualClock) -> None:
    """While a MIG preemptor waits for its victims, the slot it reserved counts as taken
    (as a reservation's GPU share does): a MIG pod that arrives meanwhile is not placed
    there, even in the pass where the victims are gone and the preemptor binds."""
    node = _mig_node_running_spot_slices(api, register_node, schedule, 7)
    _create(api, "big", "on-demand", mig="3g.40gb")
    schedule()  # slots 4-7 reserved for it, their three pods asked to stop
    _agent_step(api, node)
    _create(api, "late", "spot", mig="1g.10gb")  # 4, 5 and 6 look free but for the reservation
    clock.advance(1)
    schedule()
    pods = _pods(api)
    assert pods["big"]["phase"] == "Scheduled" and pods["big"]["mig_slot"] == 4, pods["big"]
    assert pods["late"]["phase"] == "Pending", pods["late"]
    slots = sorted(p["mig_slot"] for p in pods.values()
                   if p["phase"] in ("Scheduled", "Running"))
    assert slots == [0, 1, 2, 3, 4], slots


def test_a_mig_preemptor_binds_only_once_its_victims_have_left_the_slot(
        api: TestClient, register_node: Register, schedule: Tick, clock: ManualClock) -> None:
    """Four 1g pods and a 3g preemptor: their compute shares add up to less than a GPU
    (4 x 142 + 428 milli), so the share alone would let it bind while its victims still
    hold their slices of its slot; it waits for their stop instead."""
    node = _mig_node_running_spot_slices(api, register_node, schedule, 4)
    _create(api, "big", "on-demand", mig="3g.40gb")
    schedule()
    victims = {n: p["mig_slot"] for n, p in _pods(api).items()
               if p["desired_state"] == "stopped"}
    slot = _pods(api)["big"]["mig_slot"]
    assert victims and all(slot <= s < slot + 4 for s in victims.values()), (slot, victims)
    clock.advance(1)
    schedule()  # the victims have not stopped yet
    assert _pods(api)["big"]["phase"] == "Pending"
    _agent_step(api, node)
    clock.advance(1)
    schedule()
    big = _pods(api)["big"]
    assert big["phase"] == "Scheduled" and big["mig_slot"] == slot, big


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
