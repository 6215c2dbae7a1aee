"""A waiting log read held by one replica answers when the chunk is stored through
another: the writer's wake-up crosses by the ``LISTEN/NOTIFY`` bridge, not by the
periodic re-read (set far longer than the wait here)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.replicas.cluster import Cluster, Replica, replica_cluster, wait_for

#: Far past the wait: only a wake-up can answer the read before its deadline.
RECHECK = 600
WAIT = 30
#: A woken read answers at once; this is slack for a loaded machine, well below WAIT.
WOKEN_WITHIN = 20.0
#: Lets the read reach its wait before the chunk is stored (were it slower, its first
#: read would find the chunk and the test would prove less, never fail for it).
SETTLE = 1.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    env = {"GPUCLOUD_LOG_WAIT_RECHECK": str(RECHECK), "GPUCLOUD_LEADER_TTL": "3"}
    with replica_cluster(2, tmp_path_factory.mktemp("log-wait"), env) as running:
        yield running


def _node(cluster: Cluster, replica: Replica) -> dict[str, Any]:
    return cluster.register_node(replica, "logs-node")


def _as_agent(cluster: Cluster, replica: Replica, node: dict[str, Any], path: str,
              body: dict[str, Any]) -> httpx.Response:
    return cluster.on(replica, "POST", path, json=body,
                      headers={"Authorization": f"Bearer {node['node_token']}"})


def test_a_chunk_stored_on_one_replica_answers_a_read_waiting_on_another(
        cluster: Cluster) -> None:
    reader_side, writer_side = cluster.replicas
    node = _node(cluster, writer_side)
    pod = cluster.on(reader_side, "POST", "/v1/pods", json={
        "name": "talker", "image": "busybox:1", "gpus": 1}).json()
    wait_for(lambda: cluster.on(reader_side, "GET", f"/v1/pods/{pod['id']}").json()["node"],
             30, "the pod bound")
    token = node["fencing_token"]
    running = _as_agent(cluster, writer_side, node, f"/v1/agent/pods/{pod['id']}/status",
                        {"fencing_token": token, "phase": "Running"})
    assert running.status_code == 200, running.text
    answers: list[tuple[float, dict[str, Any]]] = []

    def read() -> None:
        response = cluster.on(reader_side, "GET", f"/v1/pods/{pod['id']}/logs",
                              params={"wait": WAIT})
        assert response.status_code == 200, response.text
        answers.append((time.monotonic(), response.json()))

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(timeout=SETTLE)
    assert reader.is_alive() and answers == [], "no output yet: the read waits"
    stored_at = time.monotonic()
    chunk = _as_agent(cluster, writer_side, node, f"/v1/agent/pods/{pod['id']}/logs",
                      {"fencing_token": token, "offset": 0, "data": "across\n"})
    assert chunk.status_code == 200, chunk.text
    reader.join(timeout=WOKEN_WITHIN)
    assert not reader.is_alive(), "the other replica's chunk did not wake the read"
    [(answered_at, answer)] = answers
    assert answer["text"] == "across\n"
    print(f"answered {answered_at - stored_at:.3f} s after the chunk was stored")
