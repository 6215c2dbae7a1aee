"""An agent cut off for longer than its lease: by a network partition (a namespace the test
creates, its veth set down) or by being frozen (SIGSTOP). The case fencing exists for.

Invariant, both ways: the lease expires, the node is ``Lost`` and its restart-always pod
runs again on another node; the old grant is revoked, so a write carrying it is refused
(409, stale fencing token) and changes nothing; when the agent comes back it notices, takes
a new grant (the node is ``Ready`` again with a newer token), stops and removes its stale
container, and the moved pod is untouched: still Running on the other node, restarted
exactly once, the only pod in the database.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpucloud.client.sdk import AgentClient
from gpucloud.core.errors import StaleFencingToken
from gpucloud.core.models import AgentPodStatusRequest
from gpucloud.core.phases import PodPhase
from tests.e2e.cluster import AgentProcess, wait_for
from tests.faults.cluster import COUNTER, IMAGE, FaultCloud, fault_cloud, running


@contextmanager
def namespace(index: int) -> Iterator[tuple[str, str, str]]:
    """A network namespace joined to the host by a veth pair on a /30 of its own:
    (namespace, host address, namespace address); removed afterwards."""
    name, host_if, ns_if = f"gpcf{os.getpid()}", f"gpcfh{os.getpid()}", "gpcfn0"
    host, inner = f"10.251.{index}.1", f"10.251.{index}.2"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    ip("netns", "add", name)
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if, "netns", name)
        ip("addr", "add", f"{host}/30", "dev", host_if)
        ip("link", "set", host_if, "up")
        for args in (("addr", "add", f"{inner}/30", "dev", ns_if), ("link", "set", ns_if, "up"),
                     ("link", "set", "lo", "up")):
            ip("netns", "exec", name, "ip", *args)
        yield name, host, inner
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _place_keeper(cloud: FaultCloud, stale: AgentProcess, survivor: AgentProcess) -> str:
    """Both agents started at once (an agent takes seconds to start on a loaded machine);
    the restart-always pod running on ``stale`` (``survivor`` cordoned meanwhile); its id."""
    for agent in (stale, survivor):
        agent.start()
    for agent in (stale, survivor):
        cloud.wait_started(agent)
    cloud.client.cordon(survivor.name)
    pod = cloud.create_pod("keeper", IMAGE, COUNTER, gpus=8, restart="always")
    cloud.wait_pod("keeper", "Running")
    assert cloud.client.get_pod("keeper").node == stale.name
    cloud.wait_log("keeper", "line 3\n")
    cloud.client.cordon(survivor.name, False)
    return pod.id


def _wait_moved(cloud: FaultCloud, stale: AgentProcess, survivor: str) -> int:
    """Lease lapsed → Lost → the pod runs on ``survivor``; the node's token then."""
    cloud.wait_node(stale.name, "Lost", timeout=15)
    wait_for(lambda: (p := cloud.client.get_pod("keeper")).node == survivor
             and p.phase == "Running", 20, f"keeper to run on {survivor}")
    assert len(running(stale)) == 1  # the cut-off agent cannot know yet
    return cloud.client.get_node(stale.name).fencing_token


def _assert_old_grant_refused(cloud: FaultCloud, stale: AgentProcess, pod_id: str,
                              old_token: int) -> None:
    """A write with the grant the agent held before the fault is refused, changes nothing."""
    node_token = json.loads((stale.state_dir / "node.json").read_text())["node_token"]
    client = AgentClient(cloud.url, node_token)
    try:
        with pytest.raises(StaleFencingToken):
            client.report_status(pod_id, AgentPodStatusRequest(
                fencing_token=old_token, phase=PodPhase.FAILED, exit_code=137))
    finally:
        client.close()


def _assert_healed(cloud: FaultCloud, stale: AgentProcess, survivor: str,
                   lost_token: int) -> None:
    cloud.wait_node(stale.name, "Ready", timeout=15)  # it noticed and took a new grant
    assert cloud.client.get_node(stale.name).fencing_token > lost_token
    wait_for(lambda: stale.driver().containers() == [], 15,
             f"{stale.name} to stop and remove its stale container")
    pod = cloud.client.get_pod("keeper")
    assert (pod.phase, pod.node, pod.restart_count) == ("Running", survivor, 1)
    assert [p.name for p in cloud.client.list_pods()] == ["keeper"]
    assert stale.running()  # the agent carried on: nothing made it give up


def test_a_partitioned_agents_late_writes_are_refused_and_it_stops_its_pod(
    tmp_path: Path, archive: Path, database_url: str
) -> None:
    with namespace(7) as (netns, host, inner), \
            fault_cloud(tmp_path, archive, database_url, lease_ttl=3,
                        extra_hosts=[host]) as cloud:
        url = f"http://{host}:{cloud.server.port}"
        # nsenter, not `ip netns exec`: that remounts /sys, hiding the cgroup mount runc needs
        stale = cloud.node_agent("gpu-a", prefix=["nsenter", f"--net=/run/netns/{netns}"],
                                 server_url=url, address=inner, start=False)
        pod_id = _place_keeper(cloud, stale, cloud.node_agent("gpu-b", start=False))
        old_token = cloud.client.get_node("gpu-a").fencing_token
        subprocess.run(["ip", "netns", "exec", netns, "ip", "link", "set", "gpcfn0", "down"],
                       check=True)
        lost_token = _wait_moved(cloud, stale, "gpu-b")
        _assert_old_grant_refused(cloud, stale, pod_id, old_token)
        subprocess.run(["ip", "netns", "exec", netns, "ip", "link", "set", "gpcfn0", "up"],
                       check=True)
        _assert_healed(cloud, stale, "gpu-b", lost_token)


def test_an_agent_paused_past_its_lease_notices_and_stops_its_pod(
    tmp_path: Path, archive: Path, database_url: str
) -> None:
    with fault_cloud(tmp_path, archive, database_url, lease_ttl=3) as cloud:
        stale = cloud.node_agent("gpu-a", start=False)
        pod_id = _place_keeper(cloud, stale, cloud.node_agent("gpu-b", start=False))
        old_token = cloud.client.get_node("gpu-a").fencing_token
        assert stale.process is not None
        stale.process.send_signal(signal.SIGSTOP)
        try:
            lost_token = _wait_moved(cloud, stale, "gpu-b")
            _assert_old_grant_refused(cloud, stale, pod_id, old_token)
        finally:
            stale.process.send_signal(signal.SIGCONT)
        _assert_healed(cloud, stale, "gpu-b", lost_token)
