"""Fleet benchmark: thousands of simulated agents against 2 server replicas on PostgreSQL.

Each simulated agent speaks the real agent protocol over real HTTP (register, renew its
lease every TTL/3 with jitter, long-poll its assignments, report its pods ``Running``), with
the real agent's timing: its renewal period, its exponential back-off with jitter on
failures (never a fixed short retry: a fleet retrying every 0.2 s is a retry storm that
keeps an overloaded server overloaded), a renewal given up at half the TTL as the agent
does (agent/connection.py ``lease_timeout``: longer than the server's worst answer, whose
lease statements are cut at 2 s, and short enough to send it again, to the other replica,
while the lease holds), and reports on a connection of
their own (the agent's lease thread never waits behind its pod reports); a
few worker processes each run thousands of them on one asyncio loop, out of the servers'
processes. Two ``gpucloud server`` replicas share one PostgreSQL; agents are spread over
them and move to the other replica when theirs stops answering. While the fleet runs, pods
are created through the API and placed by the real controllers; mid-run the leader replica
is killed (-9) and restarted as a follower, and 1 % of the agents are killed.

Measured: lease renewals/s and their p50/p99 latency, false ``Lost`` nodes (a node marked
Lost whose agent was alive: target 0), how fast each killed agent's node became ``Lost``
(target: within TTL + 2 s), live scheduling throughput (pods going Pending -> bound per
second while a backlog exists), the leader failover time and CPU per replica.

    .venv/bin/python bench/fleet.py --quick          # the 10-minute soak, 1,000 agents
    .venv/bin/python bench/fleet.py --quick --duration 60   # a short look
    .venv/bin/python bench/fleet.py                  # 30 min, 10,000 agents (full)

Results: printed, and bench/results/fleet.json (its "mode" says quick or full).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.postgres import free_port, postgres_server  # noqa: E402

ADMIN_KEY = "gpc_fleet-bench-admin-key"
RESULTS = ROOT / "bench" / "results"
GIB = 1024**3


# -- a small HTTP/1.1 client (raw asyncio streams: cheap next to the servers) ----------------


class Http:
    """One keep-alive connection to one of several servers; moves on when one is down."""

    def __init__(self, ports: list[int], first: int, source: str | None = None) -> None:
        self.ports, self.index = ports, first % len(ports)
        #: the local address to connect from (each simulated agent its own, see SimAgent)
        self.source = source
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.lock = asyncio.Lock()  # one request at a time on the connection
        self.last_error = ""

    def _drop(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def request(self, method: str, path: str, token: str | None,
                      body: object | None = None, timeout: float = 30.0) -> tuple[int, Any]:
        """Status and decoded JSON; (0, None) when no server answered (then the next
        request goes to the next replica)."""
        payload = b"" if body is None else json.dumps(body).encode()
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        if token:
            head += f"Authorization: Bearer {token}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        try:
            async with self.lock:
                return await asyncio.wait_for(self._exchange(head.encode() + payload), timeout)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as error:
            self.last_error = repr(error)
            self._drop()
            self.index = (self.index + 1) % len(self.ports)
            return 0, None

    async def _exchange(self, data: bytes) -> tuple[int, Any]:
        if self.reader is not None and self.reader.at_eof():
            self._drop()  # the server closed it while idle (its keep-alive timeout)
        reused = self.writer is not None
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(
                "127.0.0.1", self.ports[self.index],
                local_addr=(self.source, 0) if self.source else None)
        assert self.reader is not None and self.writer is not None
        self.writer.write(data)
        status_line = await self.reader.readline()
        if not status_line and reused:  # closed as we sent: once more on a fresh one, as
            self._drop()                # HTTP clients do (the request never got there)
            return await self._exchange(data)
        if not status_line:
            raise ConnectionResetError
        length, close = 0, False
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "connection" and "close" in value.lower():
                close = True
        raw = await self.reader.readexactly(length)
        if close:
            self._drop()
        return int(status_line.split()[1]), json.loads(raw) if raw else None


# -- the simulated agents (one worker process runs thousands) --------------------------------


@dataclass
class AgentStats:
    renewals: int = 0
    renewal_errors: int = 0
    unexpected_new_grants: int = 0
    stale_refusals: int = 0
    registered: int = 0
    reports: int = 0
    #: latency histogram, 1 ms buckets
    latency_ms: dict[int, int] = field(default_factory=dict)
    #: the longest time between two successful renewals' sends of one agent (s): the
    #: margin left on its lease is TTL minus this (and the last one's latency)
    max_gap_s: float = 0.0
    renewal_error_codes: dict[str, int] = field(default_factory=dict)

    def record(self, seconds: float) -> None:
        bucket = int(seconds * 1000)
        self.latency_ms[bucket] = self.latency_ms.get(bucket, 0) + 1


class SimAgent:
    """Register, renew, long-poll, report: what gpucloud's agent does, minus containers."""

    def __init__(self, name: str, ports: list[int], index: int, join_token: str,
                 stats: AgentStats) -> None:
        self.name, self.join_token, self.stats = name, join_token, stats
        # Each agent from an address of its own (127.0.0.0/8 is all loopback), as real
        # nodes are: the server's auth-failure limits count per TCP peer, and a fleet on one
        # address would share one bucket (a few refused tokens then block every renewal).
        source = agent_address(index)
        self.control = Http(ports, index, source)  # register and the lease only
        self.reports = Http(ports, index, source)
        self.poll = Http(ports, index, source)
        self.token = ""
        self.fencing = 0
        self.ttl = 10.0
        self.running: set[str] = set()

    async def register(self) -> None:
        gpus = [{"uuid": f"GPU-{self.name}-{i}", "model": "H100 80GB", "memory_mib": 81559,
                 "index": i, "numa_node": i // 4} for i in range(8)]
        body = {"join_token": self.join_token, "name": self.name, "cpu_cores": 128,
                "memory_bytes": 1024 * GIB, "gpus": gpus}
        while True:
            status, out = await self.control.request("POST", "/v1/agent/register", None, body)
            if status == 201:
                self.token, self.fencing = out["node_token"], out["fencing_token"]
                self.ttl = float(out["lease_ttl_seconds"])
                self.stats.registered += 1
                return
            await asyncio.sleep(0.5 + random.random())

    async def lease_loop(self) -> None:
        """Every TTL/3 at a fixed rate, as the agent does (agent/renewal.py: each renewal
        due a period after the previous one was *sent*, not after its answer), jittered by
        ±10 % so the fleet does not renew in lockstep; on a failure, the agent's back-off."""
        due = time.monotonic() + random.uniform(0, self.ttl / 3)
        failures = 0
        last_sent: float | None = None
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            sent = time.monotonic()
            started = time.perf_counter()
            status, out = await self.control.request(
                "POST", "/v1/agent/lease", self.token, {"fencing_token": self.fencing},
                timeout=self.ttl / 2)
            if status == 200:
                self.stats.renewals += 1
                self.stats.record(time.perf_counter() - started)
                if out["new_grant"]:
                    self.stats.unexpected_new_grants += 1
                self.fencing = out["fencing_token"]
            elif status == 401:  # its token was replaced (a registration answered late,
                await self.register()  # after its retry): register again, as the agent does
                continue
            elif status == 409:
                self.stats.stale_refusals += 1
                status, out = await self.control.request("POST", "/v1/agent/lease", self.token,
                                                         {"fencing_token": None},
                                                         timeout=self.ttl / 2)
                if status == 200:
                    self.fencing = out["fencing_token"]
            else:
                self.stats.renewal_errors += 1
                code = str(status)  # 0: no answer within the TTL, or the replica was down
                self.stats.renewal_error_codes[code] = self.stats.renewal_error_codes.get(
                    code, 0) + 1
                failures += 1
                due = time.monotonic() + min(backoff(failures), self.ttl / 3)
                continue
            failures = 0
            if last_sent is not None:
                self.stats.max_gap_s = max(self.stats.max_gap_s, sent - last_sent)
            last_sent = sent
            due = sent + self.ttl / 3 * random.uniform(0.9, 1.1)

    async def watch_loop(self) -> None:
        revision: int | None = None
        failures = 0
        while True:
            query = "wait=25" + (f"&revision={revision}" if revision is not None else "")
            status, out = await self.poll.request("GET", f"/v1/agent/assignments?{query}",
                                                  self.token, timeout=40)
            if status != 200:
                failures += 1
                await asyncio.sleep(backoff(failures))
                continue
            failures = 0
            revision = out["revision"]
            for pod in out["pods"]:
                if pod["phase"] in ("Scheduled", "Pulling") and pod["pod_id"] not in self.running:
                    await self.report(pod)

    async def report(self, pod: dict[str, Any]) -> None:
        body = {"fencing_token": self.fencing, "phase": "Running", "attempt": pod["attempt"]}
        status, _ = await self.reports.request(
            "POST", f"/v1/agent/pods/{pod['pod_id']}/status", self.token, body)
        if status == 200:
            self.running.add(pod["pod_id"])
            self.stats.reports += 1


def agent_address(index: int) -> str:
    """Agent ``index``'s loopback address, 127.1.x.y (127.0.0.1 is the API clients')."""
    return f"127.1.{index // 250 % 250}.{index % 250 + 1}"


def backoff(failures: int, base: float = 0.2, cap: float = 5.0) -> float:
    """The agent's back-off (agent/backoff.py): doubling from ``base`` up to ``cap``, each
    delay jittered down to half so that a fleet failing together retries spread out."""
    return min(cap, base * 2.0 ** min(failures - 1, 30)) * random.uniform(0.5, 1.0)


async def _worker(config: dict[str, Any]) -> None:
    """Runs ``config['count']`` agents; obeys ``kill N`` and ``stop`` lines on stdin."""
    stats = AgentStats()
    agents = [SimAgent(f"{config['prefix']}-{i}", config["ports"], i, config["join_token"],
                       stats) for i in range(config["first"], config["first"] + config["count"])]
    semaphore = asyncio.Semaphore(64)

    async def bring_up(agent: SimAgent) -> list[asyncio.Task[None]]:
        async with semaphore:
            await agent.register()
        return [asyncio.create_task(agent.lease_loop()), asyncio.create_task(agent.watch_loop())]

    tasks = await asyncio.gather(*(bring_up(a) for a in agents))
    _emit({"event": "registered", "count": len(agents)})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    alive = list(range(len(agents)))
    while line := (await reader.readline()).decode().split():
        if line[0] == "kill":
            victims = [alive.pop() for _ in range(min(int(line[1]), len(alive)))]
            for v in victims:
                for task in tasks[v]:
                    task.cancel()
                agents[v].control._drop()
                agents[v].reports._drop()
                agents[v].poll._drop()
            _emit({"event": "killed", "names": [agents[v].name for v in victims],
                   "at": time.time()})
        elif line[0] == "stop":
            break
    _emit({"event": "stats", **stats.__dict__,
           "latency_ms": {str(k): v for k, v in stats.latency_ms.items()}})


def _emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


# -- the coordinator ------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _group_stats(pgid: int) -> list[list[str]]:
    """The /proc stat fields (after the name) of each process in group ``pgid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid:
            found.append(fields)
    return found


def group_cpu_seconds(pgid: int) -> float:
    """CPU of every process in process group ``pgid`` (a replica and its workers)."""
    ticks = sum(int(f[11]) + int(f[12]) for f in _group_stats(pgid))
    return ticks / os.sysconf("SC_CLK_TCK")


def group_alive(pgid: int) -> bool:
    return any(f[0] != "Z" for f in _group_stats(pgid))


class Replica:
    """One ``gpucloud server`` process (controllers on; the leader holds their lease)."""

    def __init__(self, name: str, database_url: str, ttl: float, workers: int = 1) -> None:
        self.name, self.port = name, free_port()
        #: processes of this replica (``--workers``: they share the ports, SO_REUSEPORT,
        #: so they need a fixed SSH port, not 0)
        self.workers = workers
        self.ssh_port = free_port() if workers > 1 else 0
        self.home = Path(tempfile.mkdtemp(prefix=f"gpucloud-fleet-{name}-"))
        self.env = {**os.environ, "GPUCLOUD_HOME": str(self.home),
                    "GPUCLOUD_ADMIN_KEY": ADMIN_KEY, "GPUCLOUD_DATABASE_URL": database_url,
                    "GPUCLOUD_LEASE_TTL": str(ttl)}
        self.process: subprocess.Popen[bytes] | None = None
        self.cpu_before_restart = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gpucloud.cli.main", "server", "--port", str(self.port),
             "--ssh-port", str(self.ssh_port), "--workers", str(self.workers)],
            env=self.env, stdout=subprocess.DEVNULL, start_new_session=True,  # its own group
            stderr=open(self.home / "stderr.log", "ab"))  # noqa: SIM115
        deadline = time.monotonic() + 180  # a restart beside a replica at full load
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"replica {self.name} exited: "
                                   f"{(self.home / 'stderr.log').read_text()[-2000:]}")
            with suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"replica {self.name} did not become healthy: "
                           f"{(self.home / 'stderr.log').read_text()[-2000:]}")

    def cpu(self) -> float:
        """CPU seconds of the whole process group (the replica and its workers)."""
        return self.cpu_before_restart + (group_cpu_seconds(self.process.pid)
                                          if self.process else 0)

    def kill(self) -> None:
        """kill -9 of the whole replica: its main process and every worker at once."""
        assert self.process is not None
        self.cpu_before_restart += group_cpu_seconds(self.process.pid)
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        deadline = time.monotonic() + 10
        while group_alive(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the workers are gone too

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            with suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=20)
        if self.process is not None:  # whatever of the group is left
            with suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)


class Monitor(threading.Thread):
    """Samples the database every 0.25 s: Lost nodes, pending and bound pods, the leader."""

    def __init__(self, database_url: str, prefix: str) -> None:
        super().__init__(daemon=True)
        self.engine = sa.create_engine(database_url.replace("+psycopg", "+psycopg"))
        self.prefix = prefix
        self.lost_at: dict[str, float] = {}  # first time each node was seen Lost
        self.entries: dict[str, list[float]] = {}  # every time it went Lost
        self.lost_now: set[str] = set()
        self.samples: list[tuple[float, int, int]] = []  # (time, pending, bound)
        self.leader: list[tuple[float, str | None, int | None]] = []
        #: what PostgreSQL's active sessions waited on, summed over samples (one a second):
        #: "what saturated" when renewals or binds slow down
        self.waits: dict[str, int] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.25):
            with suppress(sa.exc.OperationalError), self.engine.connect() as db:
                now = time.time()
                lost = {name for (name,) in db.execute(sa.text(
                        "SELECT name FROM nodes WHERE status = 'Lost' AND name LIKE :p"),
                        {"p": f"{self.prefix}-%"})}
                for name in lost - self.lost_now:  # each time a node goes Lost
                    self.lost_at.setdefault(name, now)
                    self.entries.setdefault(name, []).append(now)
                self.lost_now = lost
                pending, bound = db.execute(sa.text(
                    "SELECT count(*) FILTER (WHERE node_id IS NULL AND phase = 'Pending'),"
                    " count(*) FILTER (WHERE node_id IS NOT NULL) FROM pods")).one()
                self.samples.append((now, int(pending), int(bound)))
                row = db.execute(sa.text("SELECT holder, token FROM controller_leases "
                                         "WHERE name = 'controllers'")).first()
                self.leader.append((now, row[0] if row else None, row[1] if row else None))
                if len(self.samples) % 4 == 0:
                    self._sample_waits(db)

    def _sample_waits(self, db: sa.Connection) -> None:
        for wait, query, count in db.execute(sa.text(
                "SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU'),"
                " left(regexp_replace(query, '\\s+', ' ', 'g'), 48), count(*)"
                " FROM pg_stat_activity WHERE state = 'active' AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend' GROUP BY 1, 2")):
            key = f"{wait} | {query}"
            self.waits[key] = self.waits.get(key, 0) + int(count)


class Workers:
    """The agent worker processes and what they print."""

    def __init__(self, agents: int, processes: int, ports: list[int], join_token: str,
                 prefix: str) -> None:
        per = -(-agents // processes)
        self.procs: list[subprocess.Popen[str]] = []
        self.messages: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        for first in range(0, agents, per):
            config = {"first": first, "count": min(per, agents - first), "ports": ports,
                      "join_token": join_token, "prefix": prefix}
            proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(config)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self.lock:
                self.messages.append(json.loads(line))

    def of(self, event: str) -> list[dict[str, Any]]:
        with self.lock:
            return [m for m in self.messages if m["event"] == event]

    def wait_for(self, event: str, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.of(event)) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers: {len(self.of(event))}/{count} {event!r}")
            time.sleep(0.2)

    def send(self, line: str) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(line + "\n")
            proc.stdin.flush()

    def cpu(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.procs)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()


def _admin(url: str, method: str, path: str, body: object | None = None) -> Any:
    response = httpx.request(method, f"{url}{path}", json=body, timeout=30,
                             headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    response.raise_for_status()
    return response.json()


async def _create_pods(ports: list[int], first: int, count: int,
                       clients: int) -> tuple[float, int, dict[str, int]]:
    """Create ``count`` 1-GPU pods through the API, numbered from ``first`` (each wave its
    own names: a second wave named as the first is refused, 422 "already exists");
    returns (seconds, errors, the errors by status code)."""
    errors = 0
    codes: dict[str, int] = {}
    first_error: list[object] = []
    started = time.perf_counter()

    async def client(index: int) -> None:
        nonlocal errors
        http = Http(ports, index)
        for n in range(index, count, clients):
            body = {"name": f"fleet-pod-{first + n}", "image": "ghcr.io/acme/trainer:1", "gpus": 1,
                    "cpu": 1, "memory": "4Gi"}
            status, out = await http.request("POST", "/v1/pods", ADMIN_KEY, body)
            retried = status == 0
            while status == 0:  # that replica is down: the next one (the create may have
                await asyncio.sleep(0.2)  # landed before: "already exists" is then success)
                status, out = await http.request("POST", "/v1/pods", ADMIN_KEY, body)
            if retried and "already exists" in str(out):
                continue
            if status != 201:
                errors += 1
                codes[str(status)] = codes.get(str(status), 0) + 1
                if not first_error:
                    first_error.append(out)
                    print(f"pod create failed: {status} {out} {http.last_error}", flush=True)
        http._drop()

    await asyncio.gather(*(client(i) for i in range(clients)))
    return time.perf_counter() - started, errors, codes


@dataclass
class Plan:
    agents: int
    processes: int
    duration: float
    ttl: float
    pods: int
    quick: bool
    #: processes per replica (``gpucloud server --workers``)
    server_workers: int = 1


def _percentile(histogram: dict[int, int], fraction: float) -> float:
    total = sum(histogram.values())
    seen = 0
    for bucket in sorted(histogram):
        seen += histogram[bucket]
        if seen >= total * fraction:
            return float(bucket + 1)
    return 0.0


def _throughput(samples: list[tuple[float, int, int]],
                backlog: int = 1) -> tuple[float, float]:
    """Pods bound per second over the span where at least ``backlog`` pending pods
    existed; and the best 1-second rate. With ``backlog`` 1 a slow create rate bounds it
    (pods are placed as they come); with a backlog of a whole pass the scheduler does."""
    busy = [(t, b) for t, p, b in samples if p >= backlog]
    if len(busy) < 2:
        return 0.0, 0.0
    span = busy[-1][0] - busy[0][0]
    rate = (busy[-1][1] - busy[0][1]) / span if span > 0 else 0.0
    best = 0.0
    for i, (t, b) in enumerate(busy):
        for t2, b2 in busy[i + 1:]:
            if t2 - t >= 1.0:
                best = max(best, (b2 - b) / (t2 - t))
                break
    return rate, best


@contextmanager
def _cluster(plan: Plan) -> Iterator[tuple[str, list[Replica]]]:
    with postgres_server(durable=False) as database_url:
        replicas = [Replica(name, database_url, plan.ttl, plan.server_workers)
                    for name in ("a", "b")]
        try:
            replicas[0].start()  # migrates and takes the controllers' lease first: the leader
            replicas[1].start()
            yield database_url, replicas
        finally:
            for replica in replicas:
                replica.stop()


def run(plan: Plan) -> dict[str, Any]:
    prefix = f"fleet{int(time.time()) % 100000}"
    with _cluster(plan) as (database_url, replicas):
        a, b = replicas
        ports = [a.port, b.port]
        join_token = _admin(a.url, "POST", "/v1/nodes/join-tokens", {})["token"]
        monitor = Monitor(database_url, prefix)
        monitor.start()
        started = time.time()
        workers = Workers(plan.agents, plan.processes, ports, join_token, prefix)
        try:
            workers.wait_for("registered", len(workers.procs), timeout=600)
            registered_s = time.time() - started
            print(f"{plan.agents} agents registered in {registered_s:.1f} s", flush=True)
            t0, cpu0 = time.time(), [r.cpu() for r in replicas] + [workers.cpu()]
            timeline = _drive(plan, replicas, ports, workers, monitor)
            elapsed = time.time() - t0
            cpu = [(r.cpu() - c) / elapsed for r, c in zip(replicas, cpu0, strict=False)]
            agent_cpu = (workers.cpu() - cpu0[-1]) / elapsed
            workers.send("stop")
            workers.wait_for("stats", len(workers.procs), timeout=60)
        finally:
            monitor.stop.set()
            workers.close()
        monitor.join(timeout=5)
        return _summarize(plan, workers, monitor, timeline, elapsed, cpu, agent_cpu,
                          registered_s)


def _drive(plan: Plan, replicas: list[Replica], ports: list[int], workers: Workers,
           monitor: Monitor) -> dict[str, Any]:
    """Pods in two waves, the leader's kill between them, then 1 % of the agents killed."""
    end = time.time() + plan.duration
    timeline: dict[str, Any] = {}
    seconds, errors, codes = asyncio.run(_create_pods(ports, 0, plan.pods // 2, 32))
    timeline["wave1"] = {"pods": plan.pods // 2, "create_s": round(seconds, 2),
                         "errors": errors, "error_codes": codes}
    _sleep_until(time.time() + plan.duration * 0.2, end)
    leader = replicas[0]
    killed_at = time.time()
    leader_before = monitor.leader[-1] if monitor.leader else (0, None, None)
    leader.kill()
    timeline["leader_killed_at"] = killed_at
    seconds, errors, codes = asyncio.run(_create_pods(ports, plan.pods // 2,
                                                       plan.pods - plan.pods // 2, 32))
    timeline["wave2"] = {"pods": plan.pods - plan.pods // 2, "create_s": round(seconds, 2),
                         "errors": errors, "error_codes": codes}
    leader.start()  # back as a follower
    timeline["failover_s"] = _failover_seconds(monitor, killed_at, leader_before[1])
    _sleep_until(time.time() + plan.duration * 0.2, end)
    kills = max(1, plan.agents // 100)
    per = -(-kills // len(workers.procs))
    workers.send(f"kill {per}")
    workers.wait_for("killed", len(workers.procs), timeout=30)
    # however long the waves took, the kills get TTL + 2 s (and a margin) to be detected
    time.sleep(max(end - time.time(), plan.ttl + 5))
    return timeline


def _failover_seconds(monitor: Monitor, killed_at: float, holder: str | None) -> float | None:
    """Time from the kill until another holder has the controllers' lease."""
    deadline = time.time() + 120
    while time.time() < deadline:
        after = [t for t, h, _ in monitor.leader if t > killed_at and h and h != holder]
        if after:
            return round(after[0] - killed_at, 2)
        time.sleep(0.25)
    return None


def _sleep_until(when: float, end: float) -> None:
    time.sleep(max(0.0, min(when, end) - time.time()))


def _detected(monitor: Monitor, name: str, killed_at: float) -> float:
    """Seconds from the kill to Lost (0: it was Lost already and stayed so)."""
    after = [t for t in monitor.entries.get(name, []) if t >= killed_at]
    return after[0] - killed_at if after else 0.0


def _summarize(plan: Plan, workers: Workers, monitor: Monitor, timeline: dict[str, Any],
               elapsed: float, cpu: list[float], agent_cpu: float,
               registered_s: float) -> dict[str, Any]:
    stats = workers.of("stats")
    histogram: dict[int, int] = {}
    for s in stats:
        for k, v in s["latency_ms"].items():
            histogram[int(k)] = histogram.get(int(k), 0) + v
    killed = {name: m["at"] for m in workers.of("killed") for name in m["names"]}
    false_lost = sorted(n for n, times in monitor.entries.items()
                        if n not in killed or min(times) < killed[n])
    detection = {n: _detected(monitor, n, at) for n, at in killed.items()
                 if n in monitor.lost_now or any(t >= at for t in monitor.entries.get(n, []))}
    undetected = sorted(set(killed) - set(detection))
    rate, best = _throughput(monitor.samples)
    behind, _ = _throughput(monitor.samples, backlog=256)
    errors: dict[str, int] = {}
    for s in stats:
        for code, n in s["renewal_error_codes"].items():
            errors[code] = errors.get(code, 0) + n
    killed_at = timeline.get("leader_killed_at") or 0.0
    first_lost = [min(monitor.entries[n]) - killed_at for n in false_lost]
    renewals = sum(s["renewals"] for s in stats)
    return {
        "mode": "quick" if plan.quick else "full",
        "agents": plan.agents, "agent_processes": plan.processes, "replicas": 2,
        "server_workers_per_replica": plan.server_workers,
        "lease_ttl_s": plan.ttl, "measured_s": round(elapsed, 1),
        "register_all_s": round(registered_s, 1),
        "lease_renewals": renewals,
        "lease_renewals_per_s": round(renewals / elapsed, 1),
        "renewal_p50_ms": _percentile(histogram, 0.5),
        "renewal_p99_ms": _percentile(histogram, 0.99),
        "renewal_max_gap_s": round(max((s["max_gap_s"] for s in stats), default=0.0), 2),
        "renewal_errors": sum(s["renewal_errors"] for s in stats),
        "renewal_error_codes": errors,
        "unexpected_new_grants": sum(s["unexpected_new_grants"] for s in stats),
        "stale_refusals": sum(s["stale_refusals"] for s in stats),
        "false_lost": len(false_lost), "false_lost_nodes": false_lost[:20],
        "false_lost_before_leader_kill": sum(t < 0 for t in first_lost),
        "false_lost_s_after_leader_kill": ([round(min(first_lost), 1),
                                            round(max(first_lost), 1)] if first_lost else None),
        "killed_agents": len(killed),
        "lost_detected": len(detection),
        "detection_max_s": round(max(detection.values()), 2) if detection else None,
        "detection_within_ttl_plus_2": sum(d <= plan.ttl + 2 for d in detection.values()),
        "undetected": undetected[:20],
        "pods": plan.pods,
        "pods_bound": monitor.samples[-1][2] if monitor.samples else 0,
        "pods_reported_running": sum(s["reports"] for s in stats),
        "scheduling_pods_per_s": round(rate, 1),
        "scheduling_best_1s_pods_per_s": round(best, 1),
        "scheduling_pods_per_s_backlog_256": round(behind, 1),
        "leader_failover_s": timeline.get("failover_s"),
        "cpu_cores_per_replica": [round(c, 2) for c in cpu],
        "cpu_cores_agent_workers": round(agent_cpu, 2),
        "machine_cores": os.cpu_count(),
        "waves": {"1": timeline.get("wave1"), "2": timeline.get("wave2")},
        "postgres_active_waits": dict(sorted(monitor.waits.items(),
                                             key=lambda kv: -kv[1])[:12]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the 10-minute soak with 1,000 agents (default: 30 min, 10,000)")
    parser.add_argument("--agents", type=int)
    parser.add_argument("--processes", type=int)
    parser.add_argument("--duration", type=float, help="seconds measured")
    parser.add_argument("--ttl", type=float, default=10.0, help="lease TTL (s)")
    parser.add_argument("--pods", type=int)
    parser.add_argument("--server-workers", type=int, default=1,
                        help="processes per replica (gpucloud server --workers)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(_worker(json.loads(args.worker)))
        return
    quick = args.quick
    plan = Plan(agents=args.agents or (1000 if quick else 10_000),
                processes=args.processes or (2 if quick else 8),
                duration=args.duration or (600.0 if quick else 1800.0), ttl=args.ttl,
                pods=args.pods or (2000 if quick else 20_000), quick=quick,
                server_workers=args.server_workers)
    result = run(plan)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "fleet.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for key, value in result.items():
        print(f"{key:>32}: {value}")


if __name__ == "__main__":
    main()
