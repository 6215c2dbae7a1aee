"""A fixed MIG layout end to end (h100-1): the GPU already has two 3g.40gb instances (an
admin made them; the simulated GPU's state file stands for the hardware), the node
advertises them, and under `node mig --mode fixed` the scheduler gives each 3g pod one of
them — the container sees that instance — while a 1g pod waits (nothing new is made) and a
pod's end leaves its instance in place."""

from __future__ import annotations

import json
from functools import partial

from gpucloud.core.models import PodOut
from gpucloud.gpu.profiles import simulated_uuid
from tests.e2e.cluster import Cloud, wait_for
from tests.e2e.conftest import PushedImages

PROBE = ["sh", "-c", "echo nvidia=$NVIDIA_VISIBLE_DEVICES; sleep 60"]


def _on_mig(cloud: Cloud, name: str) -> PodOut | None:
    pod = cloud.client.get_pod(name)
    return pod if pod.phase == "Running" and pod.mig_device is not None else None


def test_fixed_layout_pods_get_the_existing_instances(cloud: Cloud,
                                                      images: PushedImages) -> None:
    agent = cloud.agent("fixed", simulate="h100-1", start=False)
    gpu = simulated_uuid("fixed", 0)
    layout = [{"gpu_index": 0, "gpu_uuid": gpu, "profile": "3g.40gb", "slot": slot,
               "size": 4, "gi_id": gi, "ci_id": 0, "uuid": f"MIG-admin-{slot}"}
              for gi, slot in ((1, 0), (2, 4))]
    state = agent.state_dir / "mig" / "simulated-gpus.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps(layout))
    agent.start()
    cloud.wait_started(agent)
    node = cloud.client.set_mig_policy("fixed", "fixed")
    assert [(m.profile, m.slot) for m in node.gpus[0].mig_instances] == [
        ("3g.40gb", 0), ("3g.40gb", 4)]
    for name, profile in (("a", "3g.40gb"), ("b", "3g.40gb"), ("small", "1g.10gb")):
        cloud.create_pod(name, images.busybox, PROBE, mig=profile)
    seen = {}
    for name in ("a", "b"):
        pod = wait_for(partial(_on_mig, cloud, name), 30,
                       f"pod {name} running on an existing instance")
        assert pod.mig_device is not None and pod.mig_device.slot == pod.mig_slot
        assert cloud.wait_log(name, "nvidia=").splitlines()[0] == \
            f"nvidia={pod.mig_device.mig_uuid}"
        seen[pod.mig_slot] = pod.mig_device.mig_uuid
    assert seen == {0: "MIG-admin-0", 4: "MIG-admin-4"}
    wait_for(lambda: cloud.client.get_pod("small").reason == "Unschedulable" or None, 20,
             "the 1g pod to wait: a fixed layout has no 1g instance")
    cloud.client.stop_pod("a", grace=0)
    cloud.wait_pod("a", "Stopped")
    assert {i["uuid"] for i in json.loads(state.read_text())} == {"MIG-admin-0", "MIG-admin-4"}
    cloud.client.stop_pod("b", grace=0)
