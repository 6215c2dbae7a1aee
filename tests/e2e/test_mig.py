"""MIG end to end with simulated agents (h100-1): the scheduler picks each pod's GPU and
start slot, the node makes the instance exactly there and the container sees it."""

from __future__ import annotations

import json

from gpucloud.core.errors import InvalidInput
from gpucloud.core.models import PodOut
from tests.e2e.cluster import AgentProcess, Cloud, wait_for
from tests.e2e.conftest import PushedImages

PROBE = ["sh", "-c", "echo nvidia=$NVIDIA_VISIBLE_DEVICES; sleep 60"]


def _node_instances(agent: AgentProcess) -> dict[str, tuple[str, int]]:
    """The simulated GPU's MIG instances: MIG UUID -> (profile, slot)."""
    path = agent.state_dir / "mig" / "simulated-gpus.json"
    items = json.loads(path.read_text()) if path.exists() else []
    return {i["uuid"]: (i["profile"], i["slot"]) for i in items}


def _running_on_mig(cloud: Cloud, name: str) -> PodOut:
    def check() -> PodOut | None:
        pod = cloud.client.get_pod(name)
        return pod if pod.phase == "Running" and pod.mig_device is not None else None

    pod = wait_for(check, 30, f"pod {name} running on its MIG device")
    assert pod.mig_device is not None and pod.mig_device.slot == pod.mig_slot
    log = cloud.wait_log(name, "nvidia=")
    assert log.splitlines()[0] == f"nvidia={pod.mig_device.mig_uuid}"
    return pod


def test_seven_1g_fill_an_h100_the_eighth_waits_and_slots_agree(
        cloud: Cloud, images: PushedImages) -> None:
    agent = cloud.agent("mig-a", simulate="h100-1")
    for i in range(8):
        cloud.create_pod(f"m{i}", images.busybox, PROBE, mig="1g.10gb")
    pods = [_running_on_mig(cloud, f"m{i}") for i in range(7)]
    assert sorted(p.mig_slot for p in pods if p.mig_slot is not None) == list(range(7))
    assert _node_instances(agent) == {
        p.mig_device.mig_uuid: ("1g.10gb", p.mig_slot) for p in pods if p.mig_device}

    wait_for(lambda: cloud.client.get_pod("m7").reason == "Unschedulable" or None, 20,
             "the eighth pod to wait")
    why = json.dumps(cloud.client.pod_why("m7").model_dump())
    assert "no free MIG slot for 1g.10gb" in why, why
    freed = pods[3]
    cloud.client.stop_pod("m3", grace=0)
    cloud.wait_pod("m3", "Stopped")
    assert freed.mig_device is not None
    gone = freed.mig_device.mig_uuid
    wait_for(lambda: gone not in _node_instances(agent) or None, 20,
             "the stopped pod's instance to be destroyed")
    eighth = _running_on_mig(cloud, "m7")
    assert eighth.mig_slot == freed.mig_slot  # the only free slot
    for i in (0, 1, 2, 4, 5, 6, 7):
        cloud.client.stop_pod(f"m{i}", grace=0)


def test_3g_and_4g_share_one_gpu_restart_adopts_and_policy_off_refuses(
        patient_cloud: Cloud, images: PushedImages) -> None:
    cloud = patient_cloud  # the node stays Ready while its agent restarts
    agent = cloud.agent("mig-b", simulate="h100-1")
    cloud.create_pod("three", images.busybox, PROBE, mig="3g.40gb")
    cloud.create_pod("four", images.busybox, PROBE, mig="4g.40gb")
    three, four = _running_on_mig(cloud, "three"), _running_on_mig(cloud, "four")
    assert three.gpu_uuids == four.gpu_uuids
    assert {three.mig_slot, four.mig_slot} == {0, 4} and four.mig_slot == 0
    before = _node_instances(agent)
    cloud.restart_agent(agent)
    assert _node_instances(agent) == before  # adopted, not remade
    assert cloud.client.get_pod("three").phase == "Running"
    node = cloud.client.set_mig_policy("mig-b", "off")
    assert node.mig_policy == "off"
    cloud.client.stop_pod("three", grace=0)
    cloud.wait_pod("three", "Stopped")
    wait_for(lambda: len(_node_instances(agent)) == 1 or None, 20, "the 3g to be destroyed")
    cloud.create_pod("refused", images.busybox, PROBE, mig="1g.10gb")

    wait_for(lambda: cloud.client.get_pod("refused").reason == "Unschedulable" or None, 20,
             "the MIG pod to be refused")
    why = json.dumps(cloud.client.pod_why("refused").model_dump())
    assert "MIG policy off on node" in why, why
    cloud.client.stop_pod("four", grace=0)


def test_bad_mig_requests_are_422_naming_mig(cloud: Cloud, images: PushedImages) -> None:
    for fields, needle in (({"mig": "9g.90gb"}, "not a MIG profile"),
                           ({"mig": "1g.10gb", "gpus": 0.5}, "share"),
                           ({"mig": "1g.18gb", "gpu_type": "H100-80GB"}, "no MIG profile")):
        try:
            cloud.create_pod("bad", images.busybox, ["true"], **fields)
        except InvalidInput as error:
            assert error.field == "mig" and needle in error.message, error
        else:
            raise AssertionError(f"{fields} was accepted")
