"""Benchmark: usage samples ingested from 1,000 simulated pods, on PostgreSQL.

Starts PostgreSQL and ``gpucloud server`` (controllers running), registers ``--nodes``
nodes through the agent protocol (their leases renewed every few seconds, as agents do)
and creates ``--pods`` CPU pods that the scheduler binds to them. Then each node's
"agent" posts batches to ``POST /v1/agent/usage`` (its pods × ``--per-pod`` samples per
batch, cumulative counters, fresh sequence numbers) from concurrent keep-alive clients.
A batch the server sheds (503, ingest yields to API calls) is sent again after its
``Retry-After``, exactly as the agent's spool does, so nothing is lost. The simulated
agents run in a process of their own, their batches sent at ``nice`` 19: they
stand for the other machines of a fleet, so their JSON encoding neither blocks the event
loop that times the creates nor takes the creates' CPU; the server and PostgreSQL carry
the whole ingest.

Rounds, in one run (the machine is shared: compare within a run):

1. pod creates alone (p99);
2. ingest alone: the capacity, ``--samples`` samples;
3. pod creates while ingest runs at saturation the whole time (ingest keeps going until
   the creates are done): create p99 and the ingest rate during that window;
4. pod creates alone again. The pods created stay pending, so the scheduler sharing the
   workers has more to go through each round: the p99 "alone" compared with round 3 is
   the mean of rounds 1 and 4, which bracket it.

Reports samples/s, the shed (503) and retried batches, and that no sample was lost: the
rows in ``usage_samples`` equal the distinct samples sent. Prints a JSON line; writes
bench/results/usage.json.

    .venv/bin/python bench/usage.py [--pods 1000] [--nodes 100] [--samples 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import api as bench_api  # noqa: E402
from bench.api import ADMIN_KEY, RESULTS, RawClient, load, running_server  # noqa: E402
from tests.fixtures.postgres import postgres_server  # noqa: E402

from gpucloud.db.migrate import upgrade  # noqa: E402
from gpucloud.db.session import make_engine  # noqa: E402

#: The simulated nodes' lease: renewed every LEASE_EVERY seconds from one thread, which
#: a saturated server can hold up for longer than the default 10 s TTL (the bench is not
#: about leases: a node declared Lost would have its pods' samples refused).
LEASE_TTL = 60
LEASE_EVERY = 5.0
#: The simulated agents' process runs at this nice level (see Agents).
AGENTS_NICE = 19


class NodeClient(RawClient):
    """A keep-alive connection that authenticates as one node."""

    def __init__(self, port: int, token: str) -> None:
        super().__init__(port)
        self.token = token

    async def post_as_node(self, path: str, body: bytes) -> tuple[int, float | None]:
        """The status and the ``Retry-After`` seconds (None when absent)."""
        assert self.reader and self.writer
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {self.token}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        length, retry_after = 0, None
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "retry-after":
                retry_after = float(value)
        await self.reader.readexactly(length)
        return int(status_line.split()[1]), retry_after


def setup(url: str, nodes: int, pods: int) -> tuple[list[dict[str, Any]], Agents]:
    """Register nodes (their leases renewed from then on by the agents' process), create
    pods, wait until all are bound; each node with its pods, and the agents."""
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                         timeout=60)
    registered = []
    for index in range(nodes):
        token = admin.post("/v1/nodes/join-tokens").raise_for_status().json()["token"]
        body = {"join_token": token, "name": f"bench-{index}", "cpu_cores": 64,
                "memory_bytes": 512 << 30, "gpus": []}
        registered.append(admin.post("/v1/agent/register", json=body).raise_for_status()
                          .json())
    agents = Agents(url, registered)
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
    nodes_with_pods = [
        {"node_token": r["node_token"], "fencing_token": r["fencing_token"],
         "pods": [(p["id"], p.get("attempt", 1)) for p in by_node.get(name, [])]}
        for r, name in ((r, f"bench-{i}") for i, r in enumerate(registered))]
    agents.call("pods", nodes_with_pods)
    return nodes_with_pods, agents


class Agents:
    """The simulated agents (lease renewals, usage batches) in a process of their own at
    ``nice`` AGENTS_NICE: they stand for the other machines of a fleet, so neither their
    JSON encoding nor their event loop shares this process (which times the creates)
    with the creates' clients. The server and PostgreSQL carry the whole ingest."""

    def __init__(self, url: str, registered: list[dict[str, Any]]) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipe, theirs = context.Pipe()
        self.process = context.Process(target=_agents_main, args=(theirs, url, registered),
                                       daemon=True)
        self.process.start()

    def call(self, command: str, *args: Any) -> Any:
        self.pipe.send((command, args))
        return self.pipe.recv()

    def stop(self) -> None:
        if self.process.is_alive():
            self.call("quit")
        self.process.join(timeout=30)


def _feed(url: str, nodes: list[dict[str, Any]], batches: int, per_pod: int, clients: int
          ) -> tuple[threading.Thread, threading.Event, dict[str, Any]]:
    """Ingest on a thread at ``nice`` AGENTS_NICE (Linux: per thread) until its event is
    set or ``batches`` per node are sent; the result fills in."""
    done, result = threading.Event(), {}

    def run() -> None:
        os.setpriority(os.PRIO_PROCESS, 0, AGENTS_NICE)  # this thread only
        result.update(asyncio.run(ingest(url, nodes, batches, per_pod, clients, until=done)))

    thread = threading.Thread(target=run)
    thread.start()
    return thread, done, result


def _agents_main(pipe: Connection, url: str, registered: list[dict[str, Any]]) -> None:
    """The agents' process: renew the leases (at normal priority: a lapsed lease makes
    its node Lost), send batches (at ``nice`` AGENTS_NICE) when told (commands on
    ``pipe``: pods, ingest, feed, sent, stop, failures, quit)."""
    leases = Leases(url, registered)
    leases.start()
    nodes: list[dict[str, Any]] = []
    feeding: tuple[threading.Thread, threading.Event, dict[str, Any]] | None = None
    while True:
        command, args = pipe.recv()
        answer: Any = None
        if command == "pods":
            nodes = args[0]
        elif command == "ingest":  # batches, per_pod, clients, seq_offset
            for node in nodes:
                node["seq_offset"] = args[3]
            thread, _, answer = _feed(url, nodes, args[0], args[1], args[2])
            thread.join()
        elif command == "feed":  # until "stop": per_pod, clients, seq_offset
            for node in nodes:
                node["seq_offset"] = args[2]
            feeding = _feed(url, nodes, 10_000, args[0], args[1])
        elif command == "sent":
            answer = sum(n.get("sent", 0) for n in nodes)
        elif command == "stop" and feeding is not None:
            thread, done, result = feeding
            done.set()
            thread.join()
            answer, feeding = result, None
        elif command == "failures":
            answer = leases.failures
        elif command == "quit":
            leases.stopped.set()
            pipe.send(None)
            return
        pipe.send(answer)


class Leases(threading.Thread):
    """Renews every node's lease, as agents do (a node whose lease lapses is Lost, and
    its pods' samples would be refused)."""

    def __init__(self, url: str, nodes: list[dict[str, Any]]) -> None:
        super().__init__(daemon=True)
        self.url, self.nodes, self.stopped = url, nodes, threading.Event()
        self.failures = 0

    def run(self) -> None:
        clients = [httpx.Client(base_url=self.url, timeout=30,
                                headers={"Authorization": f"Bearer {n['node_token']}"})
                   for n in self.nodes]
        while not self.stopped.wait(LEASE_EVERY):
            for client, node in zip(clients, self.nodes, strict=True):
                try:
                    response = client.post("/v1/agent/lease",
                                           json={"fencing_token": node["fencing_token"]})
                    self.failures += response.status_code != 200
                except httpx.TransportError:  # the server stopping at the end
                    self.failures += not self.stopped.is_set()


@dataclass
class Tally:
    """What one ingest round sent and what came back."""

    shed: int = 0
    retried_batches: int = 0
    errors: Counter[int] = field(default_factory=Counter)


def _batch(node: dict[str, Any], seq: int, per_pod: int, start: datetime) -> bytes:
    samples = []
    for pod_id, attempt in node["pods"]:
        for step in range(per_pod):
            number = seq + step
            samples.append({
                "pod_id": pod_id, "attempt": attempt, "seq": node.get("seq_offset", 0) + number,
                "time": (start + timedelta(milliseconds=10 * number)).isoformat(),
                "cpu_seconds": number * 0.9, "memory_bytes": 1 << 30,
                "memory_peak_bytes": 1 << 30,
                "gpus": [], "net_rx_bytes": number * 1000, "net_tx_bytes": number * 500})
    return json.dumps({"fencing_token": node["fencing_token"], "samples": samples}).encode()


async def _send(client: NodeClient, body: bytes, tally: Tally) -> bool:
    """One batch until it is stored: a shed batch waits its Retry-After and goes again."""
    retried = False
    while True:
        status, retry_after = await client.post_as_node("/v1/agent/usage", body)
        if status == 200:
            tally.retried_batches += retried
            return True
        if status != 503:
            tally.errors[status] += 1
            return False
        tally.shed += 1
        retried = True
        await asyncio.sleep(retry_after if retry_after is not None else 1.0)


async def _node_loop(port: int, node: dict[str, Any], batches: int, per_pod: int,
                     start: datetime, tally: Tally, until: threading.Event | None) -> None:
    client = NodeClient(port, node["node_token"])
    await client.connect()
    try:
        for index in range(batches):
            if until is not None and until.is_set():
                return
            if not await _send(client, _batch(node, index * per_pod, per_pod, start), tally):
                return  # refused for good (counted in errors): this node stops
            node["sent"] = node.get("sent", 0) + per_pod * len(node["pods"])
    finally:
        await client.close()


async def ingest(url: str, nodes: list[dict[str, Any]], batches: int, per_pod: int,
                 clients: int, until: threading.Event | None = None) -> dict[str, Any]:
    """``clients`` node connections at a time, each posting ``batches`` batches (or until
    ``until`` is set, then stopping after the batch in hand)."""
    port = int(url.rsplit(":", 1)[1])
    start = datetime.now(UTC) - timedelta(hours=1)
    tally = Tally()
    gate = asyncio.Semaphore(clients)
    before = sum(n.get("sent", 0) for n in nodes)

    async def one(node: dict[str, Any]) -> None:
        async with gate:
            await _node_loop(port, node, batches, per_pod, start, tally, until)

    began = time.perf_counter()
    await asyncio.gather(*(one(n) for n in nodes if n["pods"]))
    elapsed = time.perf_counter() - began
    sent = sum(n.get("sent", 0) for n in nodes) - before
    pods = sum(len(n["pods"]) for n in nodes)
    return {"samples": sent, "seconds": round(elapsed, 3),
            "samples_per_second": round(sent / elapsed, 1), "shed_503": tally.shed,
            "batches_retried": tally.retried_batches, "errors": dict(tally.errors),
            "batch_samples": per_pod * round(pods / max(1, len(nodes)))}


def creates_while_ingesting(url: str, agents: Agents, args: Any
                            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Ingest at saturation from before the first create until after the last one."""
    agents.call("feed", args.per_pod, args.clients, 10_000_000)
    time.sleep(1.0)  # ingest is in full swing before the creates begin
    before = agents.call("sent")
    creates = asyncio.run(load(url, "during", args.creates, args.create_clients))
    window = agents.call("sent") - before
    ingested = agents.call("stop")
    # the rate while the creates ran (the whole round also has the ramp and the tail)
    ingested["samples_during_creates"] = window
    ingested["samples_per_second_during_creates"] = round(window / creates["seconds"], 1)
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
    parser.add_argument("--output", default=str(RESULTS / "usage.json"))
    parser.add_argument("--profile", metavar="PATH",
                        help="py-spy the server's workers during round 3 (collapsed stacks)")
    args = parser.parse_args()
    os.environ["GPUCLOUD_LEASE_TTL"] = str(LEASE_TTL)  # the server's environment
    with postgres_server(durable=True) as database_url:
        _migrate(database_url)
        bench_api._wait_healthy = _wait_healthy  # a loaded machine: over a minute to start
        with running_server(database_url, args.workers) as (url, pid):
            args.server_pid = pid
            result = _run(url, database_url, args)
    print(json.dumps(result))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")


def _wait_healthy(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            error = process.stderr.read() if process.stderr else b""
            raise RuntimeError(f"server exited: {error!r}")
        try:
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.5)
    raise RuntimeError("server did not become healthy in 300 s")


def _migrate(database_url: str) -> None:
    """Migrate once before the workers start (two workers migrating an empty database
    at once race on CREATE TABLE alembic_version)."""
    engine = make_engine(database_url)
    try:
        upgrade(engine)
    finally:
        engine.dispose()


def _stored(database_url: str) -> int:
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            return int(connection.execute(text("SELECT count(*) FROM usage_samples")).scalar_one())
    finally:
        engine.dispose()


@contextmanager
def _profiled(args: Any) -> Iterator[None]:
    """``py-spy record`` of the server and its workers while the block runs."""
    if not args.profile:
        yield
        return
    spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record",
                            "--pid", str(args.server_pid), "--subprocesses", "--nonblocking",
                            "--idle", "--threads", "-f", "raw", "-r", "50", "-o", args.profile],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2)  # attached
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)


def _run(url: str, database_url: str, args: Any) -> dict[str, Any]:
    nodes, agents = setup(url, args.nodes, args.pods)
    try:
        pods = sum(len(n["pods"]) for n in nodes)
        asyncio.run(load(url, "warmup", 200, args.create_clients))
        alone = asyncio.run(load(url, "alone", args.creates, args.create_clients))
        batches = max(1, args.samples // (pods * args.per_pod))
        ingest_alone = agents.call("ingest", batches, args.per_pod, args.clients, 0)
        # the second round: later sequence numbers of every pod
        with _profiled(args):
            during, ingest_during = creates_while_ingesting(url, agents, args)
        after = asyncio.run(load(url, "after", args.creates, args.create_clients))
        sent, lease_failures = agents.call("sent"), agents.call("failures")
    finally:
        agents.stop()
    stored = _stored(database_url)
    # Each create round leaves its pods pending (GPU pods, no GPU nodes), and the
    # scheduler in the workers goes through more of them each round: the creates alone
    # before and after bracket the round with ingest (its pending count is their mean).
    control = round((alone["p99_ms"] + after["p99_ms"]) / 2, 2)
    return {
        "backend": "postgresql", "pods": pods, "nodes": args.nodes,
        "server_workers": args.workers,
        "ingest_alone": ingest_alone, "ingest_while_creating": ingest_during,
        "create_alone": alone, "create_while_ingesting": during, "create_alone_after": after,
        "create_p99_ms_alone": control,
        "create_p99_ms_while_ingesting": during["p99_ms"],
        "create_p99_change_percent": round((during["p99_ms"] / control - 1) * 100, 1),
        "lease_failures": lease_failures,
        "samples_sent": sent, "samples_stored": stored, "samples_lost": sent - stored,
        "target_samples_per_second": 20_000,
        "agents": f"simulated agents in their own process, batches sent at nice {AGENTS_NICE}"
                  " (they stand for other machines; lease renewals at 0); the server and "
                  "PostgreSQL carry the ingest",
        "server_ingest": os.environ.get("GPUCLOUD_USAGE_INGEST", "auto"),
    }


if __name__ == "__main__":
    main()
