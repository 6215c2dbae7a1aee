"""Controllers apart from the agents (docs/replicas.md): an API replica started with
``GPUCLOUD_CONTROLLERS=0`` (``gpucloud server --no-controllers``) never takes the
controllers' lease, not even with no leader left; its agents get what the controllers'
replica binds, woken across replicas."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.replicas.cluster import Cluster, replica_cluster, wait_for

LEADER_TTL = 2.0


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Replica 0 takes the API and the agents only; replica 1 runs the controllers."""
    env = {"GPUCLOUD_LEADER_TTL": str(LEADER_TTL), "GPUCLOUD_LEASE_TTL": "60"}
    with replica_cluster(2, tmp_path_factory.mktemp("split"), env,
                         each=[{"GPUCLOUD_CONTROLLERS": "0"}, {}]) as running:
        yield running


def _holders(cluster: Cluster) -> list[str]:
    return [str(row[0]) for row in cluster.sql(
        "SELECT holder FROM controller_leases WHERE name = 'controllers'"
        " AND expires_at > now()")]


def test_the_api_replica_never_leads_and_its_agents_get_their_binds(split: Cluster) -> None:
    api, controllers = split.replicas
    wait_for(lambda: _holders(split), 60, "a leader")
    leader, _ = split.leader()
    assert leader is controllers
    node = split.register_node(api, "gpu-0")
    headers = {"Authorization": f"Bearer {node['node_token']}"}
    first = httpx.get(f"{api.url}/v1/agent/assignments", headers=headers, timeout=30).json()
    answers: list[dict[str, Any]] = []
    poll = threading.Thread(target=lambda: answers.append(httpx.get(
        f"{api.url}/v1/agent/assignments",
        params={"wait": 30, "revision": first["revision"]}, headers=headers,
        timeout=40).json()), daemon=True)
    poll.start()  # held on the API replica; the bind is the controllers replica's
    created = split.on(api, "POST", "/v1/pods", json={"name": "p", "image": "busybox:1",
                                                      "cpu": 1, "gpus": 1})
    assert created.status_code == 201, created.text
    poll.join(timeout=35)
    assert answers and [p["pod_id"] for p in answers[0]["pods"]] == [created.json()["id"]]
    split.kill(controllers)
    wait_for(lambda: not _holders(split), LEADER_TTL + 10, "the lease to lapse")
    with pytest.raises(AssertionError, match="timed out"):  # nobody takes it over
        wait_for(lambda: _holders(split), 3 * LEADER_TTL, "a new leader")
    assert split.on(api, "GET", "/healthz").status_code == 200
