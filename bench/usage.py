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

Rounds, in one run (the machine is shared: compare within a run): ingest alone first
(``--samples`` samples: the capacity), then ``--rounds`` pairs of create rounds
interleaved, alone and while ingesting, and one more alone at the end (``--creates``
creates each): alone, ingesting, alone, …, ingesting, alone. While ingesting, ingest runs
at saturation from a second before the first create until after the last one. The pods
created stay pending, so the scheduler sharing the workers has a little more to go
through each round; the alone rounds bracket the others, so a drift weighs on both
conditions alike. Per condition the creates are pooled: the p99 of ``rounds × creates``
latencies, each round's own p99 (the round-to-round spread), and a bootstrap over whole
rounds for 95 % intervals of both p99s and of their ratio.

Reports samples/s, the shed (503) and retried batches, and that no sample was lost: the
rows in ``usage_samples`` equal the distinct samples sent. Prints a JSON line; writes
bench/results/usage.json.

    .venv/bin/python bench/usage.py [--pods 1000] [--nodes 100] [--samples 200000]
        [--rounds 10] [--creates 500]
    .venv/bin/python bench/usage.py --ingest-only [--passes 3] [--output …]

The ingest-alone passes send batches encoded before each pass's clock starts (the
agents stand for other machines); ``--ingest-only`` runs only such passes, each reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import statistics
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
import psycopg
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
#: The warm-up batches' first sequence number: above every pass's and round's.
WARMUP_SEQ = 10**12
#: Seconds between rounds: ingest's last batches and the busy stretch are over.
SETTLE_SECONDS = 1.0
#: pg_stat_activity is sampled this often during the create rounds (see Waits).
WAITS_EVERY = 0.01
_WAITS = (
    "SELECT CASE WHEN application_name = 'gpucloud-usage-ingest' THEN 'ingest' ELSE 'api'"
    " END, coalesce(wait_event_type || ':' || wait_event, 'CPU'), count(*)"
    " FROM pg_stat_activity WHERE state = 'active' AND backend_type = 'client backend'"
    " AND pid <> pg_backend_pid() GROUP BY 1, 2")
#: Every PLACED_EVERY samples, where the ingest backends are (cgroup, nice: see Waits).
PLACED_EVERY = 20
_INGEST_PIDS = ("SELECT pid FROM pg_stat_activity"
                " WHERE application_name = 'gpucloud-usage-ingest'")


class NodeClient(RawClient):
    """A keep-alive connection that authenticates as one node."""

    def __init__(self, port: int, token: str) -> None:
        super().__init__(port)
        self.token = token

    async def post_as_node(self, path: str, body: bytes) -> tuple[int, float | None]:
        """The status and the ``Retry-After`` seconds (None when absent). A keep-alive
        connection the server closed meanwhile (idle past its timeout on a loaded
        machine) is opened again and the batch resent, as an HTTP client does."""
        try:
            return await self._post_once(path, body)
        except (ConnectionError, IndexError, asyncio.IncompleteReadError):
            try:
                await self.close()
            except OSError:
                pass  # already reset by the server
            await self.connect()
            return await self._post_once(path, body)

    async def _post_once(self, path: str, body: bytes) -> tuple[int, float | None]:
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


class Waits:
    """What the active PostgreSQL backends wait on, sampled every WAITS_EVERY seconds
    from a process of its own (not this one's GIL, which times the creates): per class,
    ``ingest`` (the ingest workers' sessions, by application_name) and ``api`` (every
    other client backend: creates, the scheduler, leases), the share of the active
    backends seen in each wait event (``CPU``: none)."""

    def __init__(self, database_url: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipe, theirs = context.Pipe()
        dsn = database_url.replace("postgresql+psycopg://", "postgresql://")
        self.process = context.Process(target=_waits_main, args=(theirs, dsn), daemon=True)
        self.process.start()

    @contextmanager
    def sampled(self, name: str) -> Iterator[None]:
        """Sample while the block runs, adding to what ``name`` has had so far."""
        self.pipe.send(("start", name))
        try:
            yield
        finally:
            self.pipe.send(("stop", name))
            self.pipe.recv()

    def report(self) -> dict[str, Any]:
        """Per name, over all its blocks: the shares (see _shares)."""
        self.pipe.send(("report", ""))
        found: dict[str, Any] = self.pipe.recv()
        return found

    def stop(self) -> None:
        self.pipe.send(("quit", ""))
        self.process.join(timeout=10)


def _waits_main(pipe: Connection, dsn: str) -> None:
    seen: dict[str, Counter[tuple[str, str]]] = {}
    placed: dict[str, Counter[str]] = {}
    ticks: Counter[str] = Counter()
    with psycopg.connect(dsn, autocommit=True) as connection:
        while True:
            command, name = pipe.recv()
            if command == "quit":
                return
            if command == "report":
                pipe.send({n: {**_shares(seen[n], ticks[n]),
                               "ingest_backends_placed": dict(placed[n])} for n in seen})
                continue
            assert command == "start"
            waits, where = seen.setdefault(name, Counter()), placed.setdefault(name, Counter())
            while not pipe.poll(WAITS_EVERY):
                ticks[name] += 1
                for who, wait, count in connection.execute(_WAITS):
                    waits[(who, wait)] += int(count)
                if ticks[name] % PLACED_EVERY == 1:
                    for (pid,) in connection.execute(_INGEST_PIDS):
                        where[_placement(int(pid))] += 1
            pipe.recv()  # "stop"
            pipe.send(None)


def _placement(pid: int) -> str:
    """Where an ingest backend runs: its cpu cgroup (with ``cpu.idle``) and nice level."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        nice = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16]
    except OSError:
        return "gone"
    group = next((line.split(":", 2)[2] for line in lines
                  if "cpu" in line.split(":")[1].split(",")), "?")
    try:
        idle = Path(f"/sys/fs/cgroup/cpu{group}/cpu.idle").read_text().strip()
    except OSError:
        idle = "-"
    return f"cgroup {group} idle={idle} nice={nice}"


def _shares(seen: Counter[tuple[str, str]], ticks: int) -> dict[str, Any]:
    """Per class: mean active backends, and each wait event's share of them (top 8)."""
    out: dict[str, Any] = {"ticks": ticks}
    for who in ("api", "ingest"):
        total = sum(n for (w, _), n in seen.items() if w == who)
        waits = sorted(((wait, n) for (w, wait), n in seen.items() if w == who),
                       key=lambda item: -item[1])[:8]
        out[who] = {"active_mean": round(total / max(1, ticks), 3),
                    "share": {wait: round(n / total, 3) for wait, n in waits}}
    return out


def _feed(url: str, nodes: list[dict[str, Any]], batches: int, per_pod: int, clients: int,
          bodies: dict[int, list[bytes]] | None = None
          ) -> tuple[threading.Thread, threading.Event, dict[str, Any]]:
    """Ingest on a thread at ``nice`` AGENTS_NICE (Linux: per thread) until its event is
    set or ``batches`` per node are sent (``bodies``: encoded beforehand, see ``encode``);
    the result fills in."""
    done, result = threading.Event(), {}

    def run() -> None:
        os.setpriority(os.PRIO_PROCESS, 0, AGENTS_NICE)  # this thread only
        result.update(asyncio.run(ingest(url, nodes, batches, per_pod, clients, until=done,
                                         bodies=bodies)))

    thread = threading.Thread(target=run)
    thread.start()
    return thread, done, result


def _agents_main(pipe: Connection, url: str, registered: list[dict[str, Any]]) -> None:
    """The agents' process: renew the leases (at normal priority: a lapsed lease makes
    its node Lost), send batches (at ``nice`` AGENTS_NICE) when told (commands on
    ``pipe``: pods, encode, ingest, feed, sent, stop, failures, quit)."""
    leases = Leases(url, registered)
    leases.start()
    nodes: list[dict[str, Any]] = []
    encoded: tuple[dict[int, list[bytes]], float] = ({}, 0.0)
    feeding: tuple[threading.Thread, threading.Event, dict[str, Any]] | None = None
    while True:
        command, args = pipe.recv()
        answer: Any = None
        if command == "pods":
            nodes = args[0]
        elif command == "encode":  # batches, per_pod, seq_offset: the next ingest's
            for node in nodes:
                node["seq_offset"] = args[2]
            encoded = encode(nodes, args[0], args[1])
        elif command == "ingest":  # batches, per_pod, clients: the bodies encoded last
            thread, _, answer = _feed(url, nodes, args[0], args[1], args[2], encoded[0])
            thread.join()
            answer.update(pre_encoded=True, encode_seconds=round(encoded[1], 3))
            encoded = ({}, 0.0)
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
                     start: datetime, tally: Tally, until: threading.Event | None,
                     bodies: list[bytes] | None = None) -> None:
    """Send the node's batches: ``bodies`` when given (encoded before the pass), else
    each encoded just before it goes."""
    client = NodeClient(port, node["node_token"])
    await client.connect()
    try:
        for index in range(batches):
            if until is not None and until.is_set():
                return
            body = (bodies[index] if bodies is not None
                    else _batch(node, index * per_pod, per_pod, start))
            if not await _send(client, body, tally):
                return  # refused for good (counted in errors): this node stops
            node["sent"] = node.get("sent", 0) + per_pod * len(node["pods"])
    finally:
        await client.close()


def _sample_start() -> datetime:
    """The first sample's time: an hour ago, so no batch is ahead of the server's clock."""
    return datetime.now(UTC) - timedelta(hours=1)


def encode(nodes: list[dict[str, Any]], batches: int, per_pod: int
           ) -> tuple[dict[int, list[bytes]], float]:
    """Every node's ``batches`` bodies, and the seconds that took. A bounded pass (ingest
    alone) sends batches encoded beforehand, in a command of its own, so that neither
    its clock nor its CPU window (``CpuSeconds``) holds the encoding: the agents stand
    for other machines, and what a pass measures is the server (an open-ended feed
    encodes as it goes, at nice 19)."""
    began, start = time.perf_counter(), _sample_start()
    bodies = {id(n): [_batch(n, index * per_pod, per_pod, start) for index in range(batches)]
              for n in nodes if n["pods"]}
    return bodies, time.perf_counter() - began


async def ingest(url: str, nodes: list[dict[str, Any]], batches: int, per_pod: int,
                 clients: int, until: threading.Event | None = None,
                 bodies: dict[int, list[bytes]] | None = None) -> dict[str, Any]:
    """``clients`` node connections at a time, each posting ``batches`` batches (or until
    ``until`` is set, then stopping after the batch in hand). ``bodies``: every node's
    batches encoded before (``encode``), else each is encoded as it goes."""
    port = int(url.rsplit(":", 1)[1])
    start = _sample_start()
    tally = Tally()
    gate = asyncio.Semaphore(clients)
    before = sum(n.get("sent", 0) for n in nodes)
    prepared = bodies or {}

    async def one(node: dict[str, Any]) -> None:
        async with gate:
            await _node_loop(port, node, batches, per_pod, start, tally, until,
                             prepared.get(id(node)))

    began = time.perf_counter()
    await asyncio.gather(*(one(n) for n in nodes if n["pods"]))
    elapsed = time.perf_counter() - began
    sent = sum(n.get("sent", 0) for n in nodes) - before
    pods = sum(len(n["pods"]) for n in nodes)
    return {"samples": sent, "seconds": round(elapsed, 3),
            "samples_per_second": round(sent / elapsed, 1), "shed_503": tally.shed,
            "batches_retried": tally.retried_batches, "errors": dict(tally.errors),
            "batch_samples": per_pod * round(pods / max(1, len(nodes))),
            "pre_encoded": False}


async def _creates(url: str, prefix: str, count: int, clients: int) -> dict[str, Any]:
    """``count`` pod creates from ``clients`` keep-alive connections: every latency (s)."""
    port = int(url.rsplit(":", 1)[1])
    names = [f"{prefix}-{i}" for i in range(count)]
    latencies: list[float] = []
    errors: list[int] = []
    began = time.perf_counter()
    await asyncio.gather(*(bench_api._client_loop(port, names[i::clients], latencies, errors)
                           for i in range(clients)))
    return {"latencies": latencies, "seconds": time.perf_counter() - began,
            "errors": len(errors)}


def _round_alone(url: str, index: int, args: Any) -> dict[str, Any]:
    return asyncio.run(_creates(url, f"alone{index}", args.creates, args.create_clients))


def _round_ingesting(url: str, index: int, agents: Agents, waits: Waits, args: Any
                     ) -> dict[str, Any]:
    """Ingest at saturation from before the first create until after the last one (its
    own sequence numbers: no sample of an earlier round is sent again); the waits are
    sampled while the creates run."""
    agents.call("feed", args.per_pod, args.clients, 10_000_000 * (index + 1))
    time.sleep(1.0)  # ingest is in full swing before the creates begin
    before = agents.call("sent")
    with waits.sampled("create_while_ingesting"):
        creates = asyncio.run(_creates(url, f"during{index}", args.creates,
                                       args.create_clients))
    window = agents.call("sent") - before
    fed = agents.call("stop")
    return {**creates, "fed": fed, "samples_during_creates": window}


def _p99(latencies: list[float]) -> float:
    """The p99 as bench/api.py takes it (the ``n // 100``-th worst), in ms."""
    ordered = sorted(latencies)
    return ordered[max(0, int(len(ordered) * 0.99) - 1)] * 1000


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of one condition pooled, with each round's own p99 (its spread)."""
    pooled = [x for r in rounds for x in r["latencies"]]
    seconds = sum(r["seconds"] for r in rounds)
    per_round = [round(_p99(r["latencies"]), 2) for r in rounds]  # in round order
    ordered = sorted(per_round)
    return {"pods": len(pooled), "rounds": len(rounds), "clients": None,
            "seconds": round(seconds, 3), "creates_per_second": round(len(pooled) / seconds, 1),
            "p50_ms": round(sorted(pooled)[len(pooled) // 2] * 1000, 2),
            "p99_ms": round(_p99(pooled), 2), "p99_tail_samples": len(pooled) // 100,
            "p99_ms_per_round": per_round,
            "p99_ms_round_spread": [ordered[0], ordered[len(ordered) // 2], ordered[-1]],
            "errors": sum(r["errors"] for r in rounds)}


def _bootstrap(alone: list[dict[str, Any]], during: list[dict[str, Any]], draws: int = 1000,
               seed: int = 12) -> dict[str, Any]:
    """95 % intervals of each p99 and of their ratio, resampling whole rounds (with
    replacement, per condition): a round-to-round swing of the machine widens them, as
    it should; resampling single creates would hide it."""
    rng = random.Random(seed)
    ratios, lows, highs = [], [], []
    for _ in range(draws):
        a = _p99([x for r in rng.choices(alone, k=len(alone)) for x in r["latencies"]])
        b = _p99([x for r in rng.choices(during, k=len(during)) for x in r["latencies"]])
        ratios.append(b / a)
        lows.append(a)
        highs.append(b)

    def interval(values: list[float], digits: int) -> list[float]:
        ordered = sorted(values)
        return [round(ordered[int(draws * 0.025)], digits),
                round(ordered[int(draws * 0.975) - 1], digits)]

    paired = _paired(alone, during)
    medians = [statistics.median(rng.choices(paired, k=len(paired))) for _ in range(draws)]
    return {"draws": draws, "resampled": "rounds", "p99_ms_alone_ci95": interval(lows, 2),
            "p99_ms_while_ingesting_ci95": interval(highs, 2),
            "create_p99_ratio_ci95": interval(ratios, 3),
            "paired_ratios": [round(r, 3) for r in paired],
            "paired_ratio_median": round(statistics.median(paired), 3),
            "paired_ratio_median_ci95": interval(medians, 3)}


def _paired(alone: list[dict[str, Any]], during: list[dict[str, Any]]) -> list[float]:
    """Each ingesting round's p99 over the mean of the two alone rounds around it: a
    drift of the machine across the run cancels within each pair."""
    return [_p99(d["latencies"]) / ((_p99(alone[i]["latencies"])
                                     + _p99(alone[i + 1]["latencies"])) / 2)
            for i, d in enumerate(during)]


def _ingest_alone(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    """Ingest with the API quiet, measured before and after the rounds (one pass swings
    with PostgreSQL's checkpoints): the pooled rate, with both passes kept."""
    samples = first["samples"] + last["samples"]
    seconds = first["seconds"] + last["seconds"]
    return {"samples": samples, "seconds": round(seconds, 3),
            "samples_per_second": round(samples / seconds, 1),
            "passes": {"before_rounds": first, "after_rounds": last}}


def _ingest_during(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The ingesting rounds' feeds summed; the rate while the creates ran."""
    fed = [r["fed"] for r in rounds]
    window = sum(r["samples_during_creates"] for r in rounds)
    seconds = sum(f["seconds"] for f in fed)
    errors: Counter[str] = Counter()
    for f in fed:
        errors.update({str(k): v for k, v in f["errors"].items()})
    return {"samples": sum(f["samples"] for f in fed), "seconds": round(seconds, 3),
            "samples_per_second": round(sum(f["samples"] for f in fed) / seconds, 1),
            "shed_503": sum(f["shed_503"] for f in fed),
            "batches_retried": sum(f["batches_retried"] for f in fed), "errors": dict(errors),
            "batch_samples": fed[0]["batch_samples"], "samples_during_creates": window,
            "samples_per_second_during_creates": round(
                window / sum(r["seconds"] for r in rounds), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--per-pod", type=int, default=50,
                        help="samples per pod in one batch (an agent's backlog)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--creates", type=int, default=500, help="creates per round")
    parser.add_argument("--rounds", type=int, default=10,
                        help="rounds while ingesting (alone: one more)")
    parser.add_argument("--create-clients", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--output", default=str(RESULTS / "usage.json"))
    parser.add_argument("--profile", metavar="PATH",
                        help="py-spy the server's workers during the rounds while ingesting "
                             "(raw collapsed stacks, PATH.<round>; with --ingest-only, "
                             "during each pass, PATH.<pass>)")
    parser.add_argument("--ingest-only", action="store_true",
                        help="no create rounds: --passes passes of ingest alone "
                             "(--samples each), each reported")
    parser.add_argument("--passes", type=int, default=3,
                        help="with --ingest-only: how many passes")
    parser.add_argument("--ids-collation", choices=("C", "default"), default="C",
                        help="usage_samples' node_id and pod_id: COLLATE \"C\" (migration "
                             "0018) or, to compare, the database's default as before it")
    args = parser.parse_args()
    os.environ["GPUCLOUD_LEASE_TTL"] = str(LEASE_TTL)  # the server's environment
    with postgres_server(durable=True) as database_url:
        _migrate(database_url, args.ids_collation)
        bench_api._wait_healthy = _wait_healthy  # a loaded machine: over a minute to start
        with running_server(database_url, args.workers) as (url, pid):
            args.server_pid = pid
            result = (_run_ingest_only if args.ingest_only else _run)(url, database_url, args)
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


#: ``--ids-collation default``: migration 0018 undone by hand after migrating (the
#: samples' ids in the database's collation again), for an A/B in one run of the lock.
_IDS_DEFAULT_COLLATION = ("ALTER TABLE usage_samples ALTER COLUMN node_id TYPE varchar(32), "
                          "ALTER COLUMN pod_id TYPE varchar(32)")


def _migrate(database_url: str, ids_collation: str = "C") -> None:
    """Migrate once before the workers start (two workers migrating an empty database
    at once race on CREATE TABLE alembic_version)."""
    engine = make_engine(database_url)
    try:
        upgrade(engine)
        if ids_collation == "default":
            with engine.begin() as connection:
                connection.execute(text(_IDS_DEFAULT_COLLATION))
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
def _profiled(args: Any, index: int) -> Iterator[None]:
    """``py-spy record`` of the server, its workers and their ingest workers while the
    block runs (``PATH.<round>``)."""
    if not args.profile:
        yield
        return
    spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record",
                            "--pid", str(args.server_pid), "--subprocesses", "--nonblocking",
                            "--idle", "--threads", "-f", "raw", "-r", "50",
                            "-o", f"{args.profile}.{index}"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2)  # attached
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)


def _processes() -> dict[int, tuple[int, int, str]]:
    """Every process: pid → (parent pid, CPU ticks, user + system, so far, cmdline)."""
    found: dict[int, tuple[int, int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            continue  # gone meanwhile
        found[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]), command)
    return found


def _cpu_classes(database_url: str) -> dict[int, str]:
    """This run's processes by what they are: the server (its API workers and main),
    the ingest workers, PostgreSQL (backends and its own processes), the simulated
    agents and the rest of the bench (py-spy included)."""
    processes = _processes()
    port = database_url.rsplit(":", 1)[1].split("/", 1)[0]
    classes: dict[int, str] = {}

    def below(root: int, name: str) -> None:
        classes[root] = name
        for pid, (parent, _, _) in processes.items():
            if parent == root and pid not in classes:
                below(pid, name)

    for pid, (_, _, command) in processes.items():
        if command.startswith(("postgres ", "/usr/lib/postgresql")) and f"-p {port}" in command:
            below(pid, "postgresql")
    below(os.getpid(), "bench")
    for pid in [p for p, name in classes.items() if name == "bench"]:
        if "gpucloud.api.usage_worker" in processes[pid][2]:
            classes[pid] = "ingest_worker"
            continue
        up = pid
        while up in processes and up != os.getpid():
            if "gpucloud.cli.main server" in processes[up][2]:
                classes[pid] = "server"
                break
            up = processes[up][0]
    return classes


class CpuSeconds:
    """CPU seconds per class of this run's processes (see _cpu_classes) over a block;
    the other processes on the machine as ``other``."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self.tick = os.sysconf("SC_CLK_TCK")

    def start(self) -> None:
        self._began = time.perf_counter()
        self._before = {pid: ticks for pid, (_, ticks, _) in _processes().items()}

    def stop(self) -> dict[str, float]:
        after, classes = _processes(), _cpu_classes(self.database_url)
        spent: Counter[str] = Counter()
        for pid, (_, ticks, _) in after.items():
            spent[classes.get(pid, "other")] += ticks - self._before.get(pid, 0)
        seconds = time.perf_counter() - self._began
        out = {name: round(value / self.tick, 2) for name, value in sorted(spent.items())}
        out["wall_seconds"] = round(seconds, 2)
        out["cpus"] = float(os.cpu_count() or 1)
        return out


def _warm_up(agents: Agents, args: Any) -> dict[str, Any]:
    """One batch per node before the passes (sequence numbers of their own): each API
    worker starts its ingest worker on its first batch (imports: seconds of CPU), which
    would otherwise weigh on the first pass alone."""
    agents.call("encode", 1, args.per_pod, WARMUP_SEQ)
    result: dict[str, Any] = agents.call("ingest", 1, args.per_pod, args.clients)
    return result


def _run_ingest_only(url: str, database_url: str, args: Any) -> dict[str, Any]:
    """``--passes`` passes of ingest alone, nothing else: the capacity, pass by pass."""
    nodes, agents = setup(url, args.nodes, args.pods)
    passes: list[dict[str, Any]] = []
    loads: list[list[str]] = []
    try:
        pods = sum(len(n["pods"]) for n in nodes)
        batches = max(1, args.samples // (pods * args.per_pod))
        warmup = _warm_up(agents, args)
        for index in range(args.passes):
            time.sleep(SETTLE_SECONDS)
            loads.append(Path("/proc/loadavg").read_text().split()[:3])
            cpu = CpuSeconds(database_url)
            agents.call("encode", batches, args.per_pod, 10_000_000 * index)  # fresh seqs
            with _profiled(args, index):
                cpu.start()  # after the encoding: the pass's CPU is the server's work
                passes.append(agents.call("ingest", batches, args.per_pod, args.clients))
                passes[-1]["cpu_seconds"] = cpu.stop()
        sent, lease_failures = agents.call("sent"), agents.call("failures")
    finally:
        agents.stop()
    stored = _stored(database_url)
    rates = [p["samples_per_second"] for p in passes]
    return {
        "backend": "postgresql", "mode": "ingest-only", "pods": pods, "nodes": args.nodes,
        "server_workers": args.workers, "clients": args.clients,
        "samples_per_second_per_pass": rates,
        "samples_per_second_median": statistics.median(rates),
        "samples_per_second_pooled": round(sum(p["samples"] for p in passes)
                                           / sum(p["seconds"] for p in passes), 1),
        "passes": passes, "warmup": warmup, "ids_collation": args.ids_collation,
        "lease_failures": lease_failures,
        "samples_sent": sent, "samples_stored": stored, "samples_lost": sent - stored,
        "target_samples_per_second": 20_000,
        "load_average_before_each_pass": loads,
        "load_average": Path("/proc/loadavg").read_text().split()[:3],
    }


def _ingest_pass(agents: Agents, database_url: str, batches: int, args: Any
                 ) -> dict[str, Any]:
    """One pass of ingest alone (batches encoded before), with its CPU seconds by class
    (as ``--ingest-only`` reports them, for the CPU per sample)."""
    cpu = CpuSeconds(database_url)
    cpu.start()
    result: dict[str, Any] = agents.call("ingest", batches, args.per_pod, args.clients)
    result["cpu_seconds"] = cpu.stop()
    return result


def _run(url: str, database_url: str, args: Any) -> dict[str, Any]:
    nodes, agents = setup(url, args.nodes, args.pods)
    waits = Waits(database_url)
    alone: list[dict[str, Any]] = []
    during: list[dict[str, Any]] = []
    try:
        pods = sum(len(n["pods"]) for n in nodes)
        asyncio.run(load(url, "warmup", 200, args.create_clients))
        batches = max(1, args.samples // (pods * args.per_pod))
        _warm_up(agents, args)
        agents.call("encode", batches, args.per_pod, 0)
        ingest_alone = _ingest_pass(agents, database_url, batches, args)
        time.sleep(SETTLE_SECONDS)
        for index in range(args.rounds):
            with waits.sampled("create_alone"):
                alone.append(_round_alone(url, index, args))
            time.sleep(SETTLE_SECONDS)
            with _profiled(args, index):
                during.append(_round_ingesting(url, index, agents, waits, args))
            time.sleep(SETTLE_SECONDS)
        with waits.sampled("create_alone"):  # the last: alone rounds bracket the others
            alone.append(_round_alone(url, args.rounds, args))
        time.sleep(SETTLE_SECONDS)
        # new sequence numbers (the rounds' feeds use 10,000,000 × round): resent ones
        # would be acknowledged as duplicates, which measures nothing
        agents.call("encode", batches, args.per_pod, 10_000_000 * (args.rounds + 1))
        ingest_alone_end = _ingest_pass(agents, database_url, batches, args)
        sent, lease_failures = agents.call("sent"), agents.call("failures")
        seen = waits.report()
    finally:
        agents.stop()
        waits.stop()
    stored = _stored(database_url)
    control, loaded = _summary(alone), _summary(during)
    for summary in (control, loaded):
        summary["clients"] = args.create_clients
    spread = _bootstrap(alone, during)
    return {
        "backend": "postgresql", "pods": pods, "nodes": args.nodes,
        "server_workers": args.workers,
        "rounds": f"{args.rounds + 1} alone and {args.rounds} while ingesting, "
                  f"{args.creates} creates each, interleaved (alone first and last)",
        "ingest_alone": _ingest_alone(ingest_alone, ingest_alone_end),
        "ingest_while_creating": _ingest_during(during),
        "create_alone": control, "create_while_ingesting": loaded,
        "create_p99_ms_alone": control["p99_ms"],
        "create_p99_ms_while_ingesting": loaded["p99_ms"],
        "create_p99_change_percent": round((loaded["p99_ms"] / control["p99_ms"] - 1) * 100,
                                           1),
        "create_p99_ratio": round(loaded["p99_ms"] / control["p99_ms"], 3),
        "create_p99_ratio_ci95": spread["create_p99_ratio_ci95"],
        "create_p99_paired_ratio_median": spread["paired_ratio_median"],
        "bootstrap": spread,
        "lease_failures": lease_failures,
        "waits": seen,
        "samples_sent": sent, "samples_stored": stored, "samples_lost": sent - stored,
        "target_samples_per_second": 20_000,
        "agents": f"simulated agents in their own process, batches sent at nice {AGENTS_NICE}"
                  " (they stand for other machines; lease renewals at 0); the server and "
                  "PostgreSQL carry the ingest",
        "server_ingest": os.environ.get("GPUCLOUD_USAGE_INGEST", "auto"),
        "ingest_commit": os.environ.get("GPUCLOUD_USAGE_INGEST_COMMIT", "lazy"),
        "ingest_backends": os.environ.get("GPUCLOUD_USAGE_INGEST_BACKENDS", "normal"),
        "ingest_cgroup": os.environ.get("GPUCLOUD_USAGE_INGEST_CGROUP", "auto"),
        "ingest_pause": os.environ.get("GPUCLOUD_USAGE_INGEST_PAUSE", "on"),
        "load_average": Path("/proc/loadavg").read_text().split()[:3],
    }


if __name__ == "__main__":
    main()
