"""Benchmark: usage samples ingested from 1,000 simulated pods, on PostgreSQL.

Starts PostgreSQL and ``gpucloud server`` (controllers running), registers ``--nodes``
nodes through the agent protocol and creates ``--pods`` CPU pods that the scheduler binds
to them. Then each node's "agent" posts batches to ``POST /v1/agent/usage`` (its pods ×
``--per-pod`` samples per batch, cumulative counters, fresh sequence numbers), from
concurrent keep-alive clients. Reports samples/s stored, and the p99 latency of pod
creates alone and while ingest runs. Prints a JSON line; writes bench/results/usage.json.

    .venv/bin/python bench/usage.py [--pods 1000] [--nodes 100] [--samples 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.api import ADMIN_KEY, RESULTS, RawClient, load, running_server  # noqa: E402
from tests.fixtures.postgres import postgres_server  # noqa: E402

from gpucloud.db.migrate import upgrade  # noqa: E402
from gpucloud.db.session import make_engine  # noqa: E402


class NodeClient(RawClient):
    """A keep-alive connection that authenticates as one node."""

    def __init__(self, port: int, token: str) -> None:
        super().__init__(port)
        self.token = token

    async def post_as_node(self, path: str, body: bytes) -> int:
        assert self.reader and self.writer
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {self.token}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        await self.reader.readexactly(length)
        return int(status_line.split()[1])


def setup(url: str, nodes: int, pods: int) -> list[dict[str, Any]]:
    """Register nodes, create pods, wait until all are bound; each node with its pods."""
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                         timeout=60)
    registered = []
    for index in range(nodes):
        token = admin.post("/v1/nodes/join-tokens").raise_for_status().json()["token"]
        body = {"join_token": token, "name": f"bench-{index}", "cpu_cores": 64,
                "memory_bytes": 512 << 30, "gpus": []}
        registered.append(admin.post("/v1/agent/register", json=body).raise_for_status()
                          .json())
    for index in range(pods):
        admin.post("/v1/pods", json={"name": f"sampled-{index}", "image": "busybox",
                                     "command": ["sleep", "1"], "cpu": 1,
                                     "memory": "1Gi"}).raise_for_status()
    deadline = time.monotonic() + 300
    while True:
        listed = admin.get("/v1/pods", params={"limit": 10000}).raise_for_status().json()
        bound = [p for p in listed if p.get("node")]
        if len(bound) >= pods or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    by_node: dict[str, list[dict[str, Any]]] = {}
    for pod in bound:
        by_node.setdefault(pod["node"], []).append(pod)
    admin.close()
    return [{"node_token": r["node_token"], "fencing_token": r["fencing_token"],
             "pods": [(p["id"], 1) for p in by_node.get(name, [])]}  # first binding
            for r, name in ((r, f"bench-{i}") for i, r in enumerate(registered))]


def _batch(node: dict[str, Any], seq: int, per_pod: int, start: datetime) -> bytes:
    samples = []
    for pod_id, attempt in node["pods"]:
        for step in range(per_pod):
            number = seq + step
            samples.append({
                "pod_id": pod_id, "attempt": attempt, "seq": node.get("seq_offset", 0) + number,
                "time": (start + timedelta(seconds=number)).isoformat(),
                "cpu_seconds": number * 0.9, "memory_bytes": 1 << 30,
                "memory_peak_bytes": 1 << 30,
                "gpus": [], "net_rx_bytes": number * 1000, "net_tx_bytes": number * 500})
    return json.dumps({"fencing_token": node["fencing_token"], "samples": samples}).encode()


async def _node_loop(port: int, node: dict[str, Any], batches: int, per_pod: int,
                     start: datetime, errors: list[int]) -> int:
    client = NodeClient(port, node["node_token"])
    await client.connect()
    sent = 0
    try:
        for index in range(batches):
            status = await client.post_as_node("/v1/agent/usage",
                                               _batch(node, index * per_pod, per_pod, start))
            if status != 200:
                errors.append(status)
            else:
                sent += per_pod * len(node["pods"])
    finally:
        await client.close()
    return sent


async def ingest(url: str, nodes: list[dict[str, Any]], samples: int, per_pod: int,
                 clients: int) -> dict[str, float]:
    """``clients`` node connections at a time, until ``samples`` are stored."""
    port = int(url.rsplit(":", 1)[1])
    pods = sum(len(n["pods"]) for n in nodes)
    batches = max(1, samples // (pods * per_pod))
    start = datetime.now(UTC) - timedelta(seconds=batches * per_pod)
    errors: list[int] = []
    gate = asyncio.Semaphore(clients)

    async def one(node: dict[str, Any]) -> int:
        async with gate:
            return await _node_loop(port, node, batches, per_pod, start, errors)

    began = time.perf_counter()
    stored = sum(await asyncio.gather(*(one(n) for n in nodes if n["pods"])))
    elapsed = time.perf_counter() - began
    return {"samples": stored, "seconds": round(elapsed, 3),
            "samples_per_second": round(stored / elapsed, 1), "errors": len(errors),
            "batch_samples": per_pod * round(pods / max(1, len(nodes)))}


async def creates_while_ingesting(url: str, nodes: list[dict[str, Any]], args: Any
                                  ) -> tuple[dict[str, float], dict[str, float]]:
    creates, ingested = await asyncio.gather(
        load(url, "during", args.creates, args.create_clients),
        ingest(url, nodes, args.samples, args.per_pod, args.clients))
    return creates, ingested


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--per-pod", type=int, default=50,
                        help="samples per pod in one batch (an agent's backlog)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--creates", type=int, default=600)
    parser.add_argument("--create-clients", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with postgres_server(durable=True) as database_url:
        _migrate(database_url)
        with running_server(database_url, args.workers) as (url, _pid):
            result = _run(url, args)
    print(json.dumps(result))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "usage.json").write_text(json.dumps(result, indent=2) + "\n")


def _migrate(database_url: str) -> None:
    """Migrate once before the workers start (two workers migrating an empty database
    at once race on CREATE TABLE alembic_version)."""
    engine = make_engine(database_url)
    try:
        upgrade(engine)
    finally:
        engine.dispose()


def _run(url: str, args: Any) -> dict[str, Any]:
    nodes = setup(url, args.nodes, args.pods)
    asyncio.run(load(url, "warmup", 200, args.create_clients))
    alone = asyncio.run(load(url, "alone", args.creates, args.create_clients))
    ingest_alone = asyncio.run(ingest(url, nodes, args.samples, args.per_pod, args.clients))
    during, ingest_during = asyncio.run(_second_round(url, nodes, args))
    return {
        "backend": "postgresql", "pods": sum(len(n["pods"]) for n in nodes),
        "nodes": args.nodes, "server_workers": args.workers,
        "ingest": ingest_alone, "ingest_while_creating": ingest_during,
        "create_p99_ms_alone": alone["p99_ms"], "create_p99_ms_while_ingesting":
            during["p99_ms"],
        "create_p99_change_percent": round((during["p99_ms"] / alone["p99_ms"] - 1) * 100, 1),
        "target_samples_per_second": 20_000,
    }


async def _second_round(url: str, nodes: list[dict[str, Any]], args: Any
                        ) -> tuple[dict[str, float], dict[str, float]]:
    """Ingest again (later sequence numbers: a second stretch of each pod's samples)
    while pods are created."""
    shifted = [{**n, "seq_offset": 10_000_000} for n in nodes]
    return await creates_while_ingesting(url, shifted, args)


if __name__ == "__main__":
    main()
