"""Invariant: a SIGKILLed agent loses nothing. Its containers keep running through the
crash (same processes), the restarted agent adopts every one of them (same container ids,
no new attempt), and the database still has each pod Running on the node, never restarted,
with no NodeLost and its log continuing."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.cluster import PATIENT_LEASE_TTL, wait_for
from tests.faults.cluster import COUNTER, IMAGE, fault_cloud, pid_alive, running


def test_kill_9_of_the_agent_loses_no_pod(tmp_path: Path, archive: Path,
                                          database_url: str) -> None:
    with fault_cloud(tmp_path, archive, database_url,
                     lease_ttl=PATIENT_LEASE_TTL) as cloud:
        agent = cloud.node_agent("gpu-a")
        names = [f"p{i}" for i in range(3)]
        for name in names:
            cloud.create_pod(name, IMAGE, COUNTER, gpus=1)
        for name in names:
            cloud.wait_log(name, "line 3\n")
        before = {c.container_id: c.pid for c in running(agent)}
        assert len(before) == 3
        token = cloud.client.get_node("gpu-a").fencing_token
        agent.kill()
        assert all(pid_alive(pid) for pid in before.values())  # the crash spared them
        agent.start()
        cloud.wait_resumed(agent, token)  # the new process holds the lease
        shipped = {name: len(cloud.client.pod_logs(name).text) for name in names}
        def all_grew() -> bool:  # logs ship again: the adopted containers are watched
            return all(len(cloud.client.pod_logs(n).text) > shipped[n] + 50 for n in names)

        wait_for(all_grew, 15, "every pod's log to continue after the restart")
        assert {c.container_id: c.pid for c in running(agent)} == before  # adopted, not rerun
        for name in names:
            pod = cloud.client.get_pod(name)
            assert (pod.phase, pod.node, pod.restart_count) == ("Running", "gpu-a", 0)
            assert "NodeLost" not in [e.reason for e in cloud.client.pod_events(name)]
        assert len(cloud.client.list_pods()) == 3
