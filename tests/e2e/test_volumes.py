"""Volumes with real agents and runc: a volume disk survives stop/start on its node while
the container disk is wiped; sizes are enforced; a network volume is shared by pods on
two agents and cannot be deleted while mounted."""

from __future__ import annotations

import re

import pytest

from gpucloud.core.errors import Conflict
from tests.e2e.cluster import AgentProcess, Cloud, wait_for
from tests.e2e.conftest import PushedImages

#: Reports which files a previous run left, writes both, then runs until stopped.
PROBE = ("for f in /workspace/x /y; do [ -f $f ] && echo found $f; done; "
         "echo kept > /workspace/x; echo wiped > /y; echo ready; "
         "trap 'exit 0' TERM; while true; do sleep 0.05; done")


def _agent(cloud: Cloud, name: str) -> AgentProcess:
    """An agent measuring disks every 0.2 s (the checked limit)."""
    agent = cloud.agent(name, start=False)
    agent.args.extend(["--disk-check-interval", "0.2"])
    agent.start()
    cloud.wait_started(agent)
    return agent


def test_stop_start_keeps_the_volume_and_wipes_the_container_disk(
    cloud: Cloud, images: PushedImages
) -> None:
    agent = _agent(cloud, "gpu-a")
    cloud.create_pod("dev", images.busybox, ["sh", "-c", PROBE], volume_size="20Mi",
                     gpus=1)
    assert cloud.wait_log("dev", "ready") == "ready\n"
    cloud.client.stop_pod("dev")
    first = cloud.wait_pod("dev", "Stopped")
    disk = agent.state_dir / "volumes" / first.id
    assert (disk / "x").read_text() == "kept\n"
    cloud.client.start_pod("dev")
    again = cloud.wait_pod("dev", "Running")
    log = cloud.wait_log("dev", "ready")
    assert log == "found /workspace/x\nready\n"  # /y was on the wiped container disk
    assert (again.node, again.volume_node, again.restart_count) == ("gpu-a", "gpu-a", 0)
    cloud.client.delete_pod("dev")

    def gone() -> bool | None:
        return True if not disk.exists() else None

    wait_for(gone, 20, "the deleted pod's volume disk to be removed")


def test_sizes_are_enforced_with_a_clear_reason(cloud: Cloud, images: PushedImages) -> None:
    _agent(cloud, "gpu-a")
    fill = "dd if=/dev/zero of={} bs=1024 count=3072; echo filled; sleep 30"
    cloud.create_pod("full", images.busybox, ["sh", "-c", fill.format("/workspace/big")],
                     volume_size="1Mi")
    cloud.create_pod("fat", images.busybox, ["sh", "-c", fill.format("/big")],
                     container_disk="1Mi")
    full = cloud.wait_pod("full", "Failed")
    assert full.reason == "VolumeFull"
    # Measured while dd may still be writing: any size past the limit.
    assert re.fullmatch(r"volume /workspace uses [\d.]+[KM]i of 1Mi; the pod was stopped",
                        full.message or ""), full.message
    fat = cloud.wait_pod("fat", "Failed")
    assert fat.reason == "ContainerDiskFull" and "of 1Mi" in (fat.message or "")
    reasons = [e.reason for e in cloud.client.pod_events("full")]
    assert "VolumeFull" in reasons


def test_a_network_volume_is_shared_by_pods_on_two_agents(
    cloud: Cloud, images: PushedImages
) -> None:
    cloud.agent("gpu-a")
    cloud.client.create_volume({"name": "data", "size": "1Gi"})
    cloud.create_pod("writer", images.busybox,
                     ["sh", "-c", "echo from-a > /data/shared; echo wrote"],
                     network_volumes=["data:/data"])
    assert cloud.wait_pod("writer", "Succeeded").node == "gpu-a"
    cloud.agent("gpu-b")
    cloud.client.cordon("gpu-a")
    cloud.create_pod("reader", images.busybox,
                     ["sh", "-c", "cat /shared/shared; trap 'exit 0' TERM; "
                                  "while true; do sleep 0.05; done"],
                     network_volumes=["data:/shared"])
    assert cloud.wait_log("reader", "from-a") == "from-a\n"
    assert cloud.client.get_pod("reader").node == "gpu-b"
    assert {n.name: n.volume_mode for n in cloud.client.list_nodes()} == {
        "gpu-a": "hostpath", "gpu-b": "hostpath"}
    with pytest.raises(Conflict, match="mounted by pod reader"):
        cloud.client.delete_volume("data")
    cloud.client.stop_pod("reader")
    cloud.wait_pod("reader", "Stopped")
    cloud.client.delete_volume("data")
    assert cloud.client.list_volumes() == []
