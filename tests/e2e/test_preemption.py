"""Preemption through server + three agents + runc: an on-demand job makes room on a
cluster full of spot pods by stopping just enough of them, and runs."""

from __future__ import annotations

from gpucloud.core.models import PodOut
from tests.e2e.cluster import Cloud, wait_for
from tests.e2e.conftest import PushedImages
from tests.e2e.test_jobs import ADDRESSES, PRINT_ENV

#: Ends on SIGTERM (within 0.2 s), so a preempted pod stops inside its grace period.
SLEEPER = ["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.2; done"]


def _fill_with_spot(cloud: Cloud, image: str) -> list[PodOut]:
    """One 8-GPU pod takes a node whole; four 4-GPU pods fill the other two, two each."""
    cloud.create_pod("whole", image, SLEEPER, gpus=8, priority_class="spot")
    for i in range(4):
        cloud.create_pod(f"half-{i}", image, SLEEPER, gpus=4, priority_class="spot")
    return [cloud.wait_pod(name, "Running")
            for name in ["whole", *(f"half-{i}" for i in range(4))]]


def test_an_on_demand_job_preempts_just_enough_spot_pods_and_runs(
    preempting_cloud: Cloud, images: PushedImages
) -> None:
    cloud = preempting_cloud
    for name, address in ADDRESSES.items():
        cloud.agent(name, address=address)
    spot = _fill_with_spot(cloud, images.busybox)
    assert all(n.gpus_allocated == 8 for n in cloud.client.list_nodes())

    cloud.client.create_job({"name": "urgent", "image": images.busybox, "nodes": 2,
                             "gpus_per_node": 8, "priority_class": "on-demand",
                             "command": ["sh", "-c", PRINT_ENV + "; exec sleep 600"]})
    job = wait_for(lambda: (j := cloud.client.get_job("urgent")).phase == "Running" and j,
                   40, "the on-demand job to run")

    # The fewest victims: the node of the 8-GPU pod (one pod) and one node of two halves.
    job_nodes = {m.node for m in job.members}
    victims = [p for p in spot if p.node in job_nodes]
    survivors = [p for p in spot if p.node not in job_nodes]
    assert len(job_nodes) == 2 and "whole" in {p.name for p in victims}
    assert len(victims) == 3 and len(survivors) == 2
    for victim in victims:
        pod = cloud.wait_pod(victim.name, "Stopped", timeout=10)
        assert (pod.reason, pod.message) == ("Preempted", "preempted by job urgent"), pod
        events = [(e.reason, e.message) for e in cloud.client.pod_events(victim.name)]
        assert ("Preempted", "preempted by job urgent") in events
    for survivor in survivors:
        pod = cloud.client.get_pod(survivor.name)
        assert (pod.phase, pod.node) == ("Running", survivor.node), pod
        assert "Preempted" not in {e.reason for e in cloud.client.pod_events(survivor.name)}

    for member in job.members:
        cloud.wait_pod(member.pod, "Running", timeout=10)
    master, port = job.members[0].address, job.master_port
    logs = wait_for(lambda: (text := cloud.client.job_logs("urgent").text).count("cuda=") == 2
                    and text, 20, "both members' output")
    for rank in (0, 1):
        assert (f"[{rank}] rank={rank} nodes=2 gpus=8 master={master}:{port} "
                f"pet={rank}/2/8@{master}:{port}") in logs.splitlines()
