"""Three `gpucloud server` replicas on one PostgreSQL, requests spread round-robin.

Invariants: every route works on any replica; one leader at a time, and when it is
kill -9'd mid-burst a follower takes over within one leader TTL, no pod is bound twice
and none is left Pending; a key revoked on one replica is refused on all within the auth
cache TTL; the replicas ride out a PostgreSQL restart by themselves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from tests.conftest import ADMIN_KEY
from tests.integration.conftest import h100_gpus
from tests.replicas.cluster import Cluster, Replica, replica_cluster, wait_for

LEADER_TTL = 3.0
AUTH_CACHE_TTL = 2.0
NODES = 4
PODS = 60


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    env = {"GPUCLOUD_LEADER_TTL": str(LEADER_TTL), "GPUCLOUD_LEASE_TTL": "60",
           "GPUCLOUD_AUTH_CACHE_TTL": str(AUTH_CACHE_TTL)}
    with replica_cluster(3, tmp_path_factory.mktemp("replicas"), env) as running:
        for index in range(NODES):
            token = running.request("POST", "/v1/nodes/join-tokens").json()["token"]
            response = running.request("POST", "/v1/agent/register", json={
                "join_token": token, "name": f"gpu-{index}", "cpu_cores": 64,
                "memory_bytes": 512 * 1024**3, "gpus": h100_gpus()})
            assert response.status_code == 201, response.text
        yield running


def _pending(cluster: Cluster) -> int:
    return int(cluster.sql("SELECT count(*) FROM pods WHERE node_id IS NULL")[0][0])


def test_leader_killed_mid_burst_fails_over_without_double_binding(cluster: Cluster) -> None:
    leader, epoch = cluster.leader()
    created, killed_at = [], 0.0
    taken_over: list[float] = []
    for index in range(PODS):
        response = cluster.request("POST", "/v1/pods", json={
            "name": f"p{index}", "image": "busybox:1", "cpu": 1})
        assert response.status_code == 201, response.text
        created.append(response.json()["id"])
        if index == PODS // 3:  # scheduling is under way: kill the leader
            cluster.kill(leader)
            killed_at = time.monotonic()
            threading.Thread(target=_watch_takeover, args=(cluster, epoch, taken_over),
                             daemon=True).start()
    wait_for(lambda: taken_over, LEADER_TTL + 30, "a new leader")
    new_leader, new_epoch = cluster.leader()
    failover = taken_over[0] - killed_at
    print(f"failover: {failover:.2f} s (leader TTL {LEADER_TTL} s)")
    assert new_leader is not leader and new_epoch > epoch
    assert failover <= LEADER_TTL + 0.5
    wait_for(lambda: _pending(cluster) == 0, 30, "every pod bound")
    bound = cluster.sql(
        "SELECT pod_id, count(*) FROM pod_events WHERE reason = 'Scheduled' GROUP BY pod_id")
    assert {pod for pod, _ in bound} == set(created)
    assert all(count == 1 for _, count in bound), "a pod was bound twice"
    per_node = cluster.sql("SELECT node_id, count(*) FROM pods GROUP BY node_id")
    assert sum(n for _, n in per_node) == PODS and all(n <= 64 for _, n in per_node)


def _status_is(cluster: Cluster, replica: Replica, path: str, key: str,
               status: int) -> bool:
    return cluster.on(replica, "GET", path, key=key).status_code == status


def _watch_takeover(cluster: Cluster, epoch: int, taken_over: list[float]) -> None:
    """Record when the lease first shows a newer epoch (polled every 20 ms)."""
    while True:
        rows = cluster.sql("SELECT token FROM controller_leases WHERE expires_at > now()")
        if rows and int(rows[0][0]) > epoch:
            taken_over.append(time.monotonic())
            return
        time.sleep(0.02)


def test_every_route_answers_on_any_replica(cluster: Cluster) -> None:
    project = cluster.request("POST", "/v1/projects", json={"name": "team"})
    assert project.status_code == 201, project.text
    for replica in cluster.live():
        assert cluster.on(replica, "GET", "/v1/projects").status_code == 200
        pods = cluster.on(replica, "GET", "/v1/pods")
        assert pods.status_code == 200 and len(pods.json()) >= PODS
        assert cluster.on(replica, "GET", "/v1/nodes").status_code == 200
    # Every documented read that takes no path parameter: the same answer on each replica.
    live = cluster.live()
    document = cluster.on(live[0], "GET", "/openapi.json").json()
    reads = sorted(path for path, item in document["paths"].items()
                   if "get" in item and "{" not in path and "/agent/" not in path
                   and "/_worker/" not in path)
    assert len(reads) >= 20, reads
    for path in reads:
        codes = {replica.url: cluster.on(replica, "GET", path).status_code for replica in live}
        assert len(set(codes.values())) == 1 and max(codes.values()) < 500, (path, codes)


def test_an_object_made_on_one_replica_is_read_changed_and_deleted_on_others(
        cluster: Cluster) -> None:
    live = cluster.live()  # two or three: an earlier test kills the leader
    first, second, third = live[0], live[1 % len(live)], live[2 % len(live)]
    made = cluster.on(first, "POST", "/v1/keys", json={"name": "spread"})
    assert made.status_code == 201, made.text
    key_id = made.json()["id"]
    assert key_id in [k["id"] for k in cluster.on(second, "GET", "/v1/keys").json()]
    template = cluster.on(second, "POST", "/v1/templates", json={
        "name": "spread", "image": "busybox:1"})
    assert template.status_code == 201, template.text
    assert cluster.on(third, "GET", "/v1/templates/spread").status_code == 200
    assert cluster.on(first, "DELETE", "/v1/templates/spread").status_code == 204
    assert cluster.on(second, "GET", "/v1/templates/spread").status_code == 404
    assert cluster.on(third, "POST", f"/v1/keys/{key_id}/revoke").status_code == 200


def test_a_revoked_key_is_refused_on_every_replica_within_the_cache_ttl(
        cluster: Cluster) -> None:
    created = cluster.request("POST", "/v1/keys", json={"name": "ci"}).json()
    key = created["key"]
    live = cluster.live()
    for replica in live:  # cached on every replica
        assert cluster.on(replica, "GET", "/v1/pods", key=key).status_code == 200
    revoked = cluster.on(live[0], "POST", f"/v1/keys/{created['id']}/revoke")
    assert revoked.status_code == 200, revoked.text
    started = time.monotonic()
    for replica in live:
        wait_for(partial(_status_is, cluster, replica, "/v1/pods", key, 401),
                 AUTH_CACHE_TTL + 1, "the revoked key refused")
    print(f"revocation seen on all replicas after {time.monotonic() - started:.2f} s")
    assert time.monotonic() - started <= AUTH_CACHE_TTL + 0.5


def test_replicas_reconnect_after_a_postgres_restart(cluster: Cluster) -> None:
    cluster.restart_postgres()
    for replica in cluster.live():
        wait_for(partial(_status_is, cluster, replica, "/v1/nodes", ADMIN_KEY, 200),
                 15, "the replica serving again")
    response = cluster.request("POST", "/v1/pods", json={"name": "after", "image":
                                                          "busybox:1", "cpu": 1})
    assert response.status_code == 201, response.text
    wait_for(lambda: _pending(cluster) == 0, LEADER_TTL + 10, "the controllers resumed")


def test_the_data_dir_is_known(cluster: Cluster) -> None:
    assert Path(cluster.data_dir, "PG_VERSION").exists()
