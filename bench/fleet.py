"""Fleet benchmark: thousands of simulated agents against 2 server replicas on PostgreSQL.

Each simulated agent speaks the real agent protocol over real HTTP (register at a random
time within a ramp, ``--ramp``, as a fleet boots over minutes, retrying with the agent's
back-off; renew its lease every TTL/3 with jitter, long-poll its assignments, report its
pods ``Running``), with
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
    .venv/bin/python bench/fleet.py --agents 10000 --ttl 60 --ramp 300 --profile 60
        # with --profile, the ramp is profiled too (bench/results/fleet-ramp-profile.json,
        # written even when the ramp does not finish); the registered count every 30 s

Results: printed, and bench/results/fleet.json (its "mode" says quick or full); with
``--backlog N`` bench/results/fleet-backlog.json.
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
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import pyspy  # noqa: E402
from tests.fixtures.postgres import free_port, postgres_server  # noqa: E402

from gpucloud.agent.backoff import Backoff  # noqa: E402
from gpucloud.agent.config import poll_wait  # noqa: E402
from gpucloud.services import lease_ttl  # noqa: E402

#: A simulated agent's own long-poll wait (s).
POLL_WAIT_S = 25.0

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
        #: the last answer's ``Retry-After`` (s), None when it had none
        self.retry_after: float | None = None

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
            self.last_error, self.retry_after = repr(error), None
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
        self.retry_after = None
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "connection" and "close" in value.lower():
                close = True
            elif name.lower() == "retry-after":
                self.retry_after = float(value)
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
    #: registrations sent again (no answer within the timeout, or an error)
    register_retries: int = 0
    #: the answers that made a registration be sent again (0: none within the timeout)
    register_error_codes: dict[str, int] = field(default_factory=dict)
    reports: int = 0
    #: latency histogram, 1 ms buckets
    latency_ms: dict[int, int] = field(default_factory=dict)
    #: the longest time between two successful renewals' sends of one agent (s): the
    #: margin left on its lease is TTL minus this (and the last one's latency)
    max_gap_s: float = 0.0
    renewal_error_codes: dict[str, int] = field(default_factory=dict)
    #: the longest lease TTL a renewal was granted (s): the server's grows with the fleet
    #: (services/lease_ttl.py), and each agent renews at a third of its latest
    ttl_max_s: float = 0.0
    #: long polls answered, and the longest wait one was sent with (s): the server asks
    #: a large fleet for longer ones (services/lease_ttl.py ``poll_wait``)
    polls: int = 0
    poll_wait_max_s: float = 0.0

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
        #: the last lease attempts (wall time sent, replica port, status, latency s, what
        #: came back): printed for each node found Lost while its agent was alive
        self.history: deque[tuple[float, int, int, float, str]] = deque(maxlen=64)

    async def _lease_request(self, fencing: int | None) -> tuple[int, Any]:
        """One renewal (the agent's ``lease_timeout``: half the TTL), kept in history."""
        port, sent, started = self.control.ports[self.control.index], time.time(), \
            time.perf_counter()
        status, out = await self.control.request(
            "POST", "/v1/agent/lease", self.token, {"fencing_token": fencing},
            timeout=self.ttl / 2)
        note = (self.control.last_error[:60] if status == 0 else
                "new grant" if status == 200 and out["new_grant"] else
                "" if status == 200 else str(out)[:80])
        self.history.append((sent, port, status, time.perf_counter() - started, note))
        return status, out

    async def register(self) -> None:
        gpus = [{"uuid": f"GPU-{self.name}-{i}", "model": "H100 80GB", "memory_mib": 81559,
                 "index": i, "numa_node": i // 4} for i in range(8)]
        body = {"join_token": self.join_token, "name": self.name, "cpu_cores": 128,
                "memory_bytes": 1024 * GIB, "gpus": gpus}
        backoff = Backoff()  # the agent's own (agent/connection.py connect)
        while True:
            status, out = await self.control.request("POST", "/v1/agent/register", None, body)
            if status == 201:
                self.token, self.fencing = out["node_token"], out["fencing_token"]
                self.ttl = float(out["lease_ttl_seconds"])
                self.stats.registered += 1
                return
            # the agent's back-off, no sooner than the server's Retry-After (a refusal
            # says when to come back: agent/connection.py connect, agent/backoff.py)
            self.stats.register_retries += 1
            codes = self.stats.register_error_codes
            cause = register_cause(status, out, self.control.last_error)
            codes[cause] = codes.get(cause, 0) + 1
            await asyncio.sleep(backoff.next_delay(self.control.retry_after))

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
            status, out = await self._lease_request(self.fencing)
            if status == 200:
                self.stats.renewals += 1
                self.stats.record(time.perf_counter() - started)
                if out["new_grant"]:
                    self.stats.unexpected_new_grants += 1
                self.fencing = out["fencing_token"]
                self.ttl = float(out["lease_ttl_seconds"])  # as the agent adopts it
                self.stats.ttl_max_s = max(self.stats.ttl_max_s, self.ttl)
            elif status == 401:  # its token was replaced (a registration answered late,
                await self.register()  # after its retry): register again, as the agent does
                continue
            elif status == 409:
                self.stats.stale_refusals += 1
                status, out = await self._lease_request(None)
                if status == 200:
                    self.fencing = out["fencing_token"]
                    self.ttl = float(out["lease_ttl_seconds"])
                else:  # as the agent's renew(): the re-acquire's failure is the renewal's
                    failures += 1  # (retried after the back-off, not a period later)
                    due = time.monotonic() + min(backoff(failures), self.ttl / 3)
                    continue
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
            due = sent + self.ttl / 3 * random.uniform(0.9, 1.0)  # the agent's jitter

    async def watch_loop(self) -> None:
        """Long polls of ``POLL_WAIT_S``, or the longer wait the server asks of a large
        fleet (``poll_wait_seconds``), as the agent's ``config.poll_wait`` takes it."""
        revision: int | None = None
        failures = 0
        wait = POLL_WAIT_S
        while True:
            query = f"wait={wait:g}" + (f"&revision={revision}" if revision is not None else "")
            status, out = await self.poll.request("GET", f"/v1/agent/assignments?{query}",
                                                  self.token, timeout=wait + 15)
            if status != 200:
                failures += 1
                await asyncio.sleep(backoff(failures))
                continue
            failures = 0
            revision = out["revision"]
            wait = poll_wait(POLL_WAIT_S, out.get("poll_wait_seconds"))
            self.stats.poll_wait_max_s = max(self.stats.poll_wait_max_s, wait)
            self.stats.polls += 1
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


def register_cause(status: int, out: Any, error: str) -> str:
    """Why a registration is sent again, for the counts: the status, and for no answer
    the client's error (a timeout, a reset), for a 503 which guard refused it."""
    if status == 0:
        return f"0 {error.partition('(')[0] or 'no answer'}"
    detail = out.get("detail") if isinstance(out, dict) else None
    if status == 503 and isinstance(detail, str):
        for guard in ("waited", "under way"):
            if guard in detail:
                return f"503 {guard}"
        return f"503 {detail[:30]}"
    return str(status)


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
        # Nodes come up over a ramp, not at one instant (a fleet boots over minutes):
        # each agent at a uniformly random time within it.
        await asyncio.sleep(random.uniform(0, config["ramp_s"]))
        async with semaphore:
            await agent.register()
        return [asyncio.create_task(agent.lease_loop()), asyncio.create_task(agent.watch_loop())]

    async def progress() -> None:  # how the ramp goes, every 10 s (the coordinator prints it)
        while True:
            await asyncio.sleep(10)
            _emit({"event": "progress", "registered": stats.registered,
                   "register_retries": stats.register_retries,
                   "register_error_codes": stats.register_error_codes, "renewals": stats.renewals,
                   "renewal_errors": stats.renewal_errors})

    reporting = asyncio.create_task(progress())
    tasks = await asyncio.gather(*(bring_up(a) for a in agents))
    reporting.cancel()
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
        elif line[0] == "trace":  # the lease history of the agents named
            wanted = set(line[1:])
            _emit({"event": "trace", "agents": {
                a.name: list(a.history) for a in agents if a.name in wanted}})
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


def postgres_cpu_seconds(database_url: str) -> float:
    """CPU of the PostgreSQL serving ``database_url`` (the postmaster found by its port,
    its live backends, and those that exited: the postmaster's reaped children)."""
    port = database_url.rsplit(":", 1)[1].split("/", 1)[0]
    ticks = 0
    master: str | None = None
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with suppress(FileNotFoundError, ProcessLookupError):
            words = cmdline.read_bytes().split(b"\0")
            if words and words[0].endswith(b"postgres") and f"-p {port}".encode() in \
                    b" ".join(words):
                master = cmdline.parent.name
                break
    if master is None:
        return 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(FileNotFoundError, ProcessLookupError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if stat.parent.name == master:
                ticks += sum(int(f) for f in fields[11:15])  # its own and reaped children
            elif fields[1] == master:
                ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def group_alive(pgid: int) -> bool:
    return any(f[0] != "Z" for f in _group_stats(pgid))


class Replica:
    """One ``gpucloud server`` process: ``controllers`` (it may lead them: the leader holds
    their lease; else ``--no-controllers``), ``agents`` (the agents and the API clients
    are spread over the replicas that have it; the others take no such traffic)."""

    def __init__(self, name: str, database_url: str, ttl: float, workers: int = 1,
                 controllers: bool = True, agents: bool = True,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.port = name, free_port()
        self.controllers, self.agents = controllers, agents
        #: processes of this replica (``--workers``: they share the ports, SO_REUSEPORT,
        #: so they need a fixed SSH port, not 0)
        self.workers = workers
        self.ssh_port = free_port() if workers > 1 else 0
        self.home = Path(tempfile.mkdtemp(prefix=f"gpucloud-fleet-{name}-"))
        self.env = {**os.environ, "GPUCLOUD_HOME": str(self.home),
                    "GPUCLOUD_ADMIN_KEY": ADMIN_KEY, "GPUCLOUD_DATABASE_URL": database_url,
                    "GPUCLOUD_LEASE_TTL": str(ttl), **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None
        self.cpu_before_restart = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gpucloud.cli.main", "server", "--port", str(self.port),
             "--ssh-port", str(self.ssh_port), "--workers", str(self.workers),
             "--controllers" if self.controllers else "--no-controllers"],
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
        #: lease_renewed_at (epoch s) of each node when it was first seen Lost
        self.lost_renewed: dict[str, float] = {}
        self.samples: list[tuple[float, int, int]] = []  # (time, pending, bound)
        self.leader: list[tuple[float, str | None, int | None]] = []
        #: what PostgreSQL's active sessions waited on, summed over samples (one a second):
        #: "what saturated" when renewals or binds slow down
        self.waits: dict[str, int] = {}
        #: who waited on a lock behind whom ("waiter | blocker's last statement"), summed
        #: over the same samples: a renewal queued behind a bind shows here
        self.blocked: dict[str, int] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.25):
            with suppress(sa.exc.OperationalError), self.engine.connect() as db:
                now = time.time()
                renewed = {name: at for name, at in db.execute(sa.text(
                    "SELECT name, extract(epoch FROM lease_renewed_at) FROM nodes"
                    " WHERE status = 'Lost' AND name LIKE :p"), {"p": f"{self.prefix}-%"})}
                lost = set(renewed)
                for name in lost - self.lost_now:  # each time a node goes Lost
                    self.lost_at.setdefault(name, now)
                    self.entries.setdefault(name, []).append(now)
                    if renewed[name] is not None:
                        self.lost_renewed.setdefault(name, float(renewed[name]))
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
        for waiter, blocker, count in db.execute(sa.text(
                "SELECT left(regexp_replace(w.query, '\\s+', ' ', 'g'), 48),"
                " left(regexp_replace(b.query, '\\s+', ' ', 'g'), 48), count(*)"
                " FROM pg_stat_activity w CROSS JOIN LATERAL unnest(pg_blocking_pids(w.pid))"
                " AS blocking(pid) JOIN pg_stat_activity b ON b.pid = blocking.pid"
                " WHERE w.wait_event_type = 'Lock' GROUP BY 1, 2")):
            key = f"{waiter} | behind: {blocker}"
            self.blocked[key] = self.blocked.get(key, 0) + int(count)


class Workers:
    """The agent worker processes and what they print."""

    def __init__(self, agents: int, processes: int, ports: list[int], join_token: str,
                 prefix: str, ramp_s: float) -> None:
        per = -(-agents // processes)
        self.procs: list[subprocess.Popen[str]] = []
        self.messages: list[dict[str, Any]] = []
        #: (worker index, message): whose progress a message is
        self.indexed: list[tuple[int, dict[str, Any]]] = []
        self.lock = threading.Lock()
        for first in range(0, agents, per):
            config = {"first": first, "count": min(per, agents - first), "ports": ports,
                      "join_token": join_token, "prefix": prefix, "ramp_s": ramp_s}
            proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(config)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(proc, len(self.procs) - 1),
                             daemon=True).start()

    def _read(self, proc: subprocess.Popen[str], index: int) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            message = json.loads(line)
            with self.lock:
                self.messages.append(message)
                self.indexed.append((index, message))

    def of(self, event: str) -> list[dict[str, Any]]:
        with self.lock:
            return [m for m in self.messages if m["event"] == event]

    def wait_for(self, event: str, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.of(event)) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers: {len(self.of(event))}/{count} {event!r}")
            time.sleep(0.2)

    def wait_registered(self, timeout: float,
                        usage: Callable[[], str] | None = None) -> None:
        """Until every worker's agents are registered; the count every 30 s meanwhile,
        with ``usage()`` (what the machine's cores went to since the last line)."""
        deadline = time.monotonic() + timeout
        shown = time.monotonic()
        while len(self.of("registered")) < len(self.procs):
            if time.monotonic() > shown + 30:
                shown = time.monotonic()
                print(f"registered: {self.registered()} (retries {self.register_retries()}"
                      f" {self.register_causes()}, renewals {self.progress('renewals')},"
                      f" renewal errors "
                      f"{self.progress('renewal_errors')}) {usage() if usage else ''}",
                      flush=True)
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers: {self.registered()} agents registered in "
                                   f"{timeout:.0f} s ({self.register_retries()} retries)")
            time.sleep(0.2)

    def _last_progress(self) -> list[dict[str, Any]]:
        last: dict[int, dict[str, Any]] = {}
        with self.lock:
            for index, message in self.indexed:
                if message["event"] in ("progress", "registered"):
                    last[index] = message
        return list(last.values())

    def progress(self, key: str) -> int:
        """The workers' last ``key`` count (their progress lines)."""
        return sum(m.get(key, 0) for m in self._last_progress())

    def registered(self) -> int:
        return sum(m.get("registered", m.get("count", 0)) for m in self._last_progress())

    def register_retries(self) -> int:
        return sum(m.get("register_retries", 0) for m in self._last_progress())

    def register_causes(self) -> dict[str, int]:
        """Why the registrations were sent again (``register_cause``), summed."""
        return _summed(m.get("register_error_codes", {}) for m in self._last_progress())

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
    #: > 0: instead of the waves and kills, this many pods created while scheduling is
    #: paused, then released at once (the live scheduling rate with a real backlog)
    backlog: int = 0
    #: profile the replicas (py-spy, bench/pyspy.py): during the drain of a backlog, or
    #: for this many seconds in the middle of an ordinary run (0: no profile)
    profile_s: float = 0.0
    #: the agents register at random times within this many seconds
    ramp_s: float = 0.0
    #: which replicas run the controllers and which take the agents (``TOPOLOGIES``)
    topology: str = "shared"
    #: pods bound per transaction (GPUCLOUD_BIND_CHUNK; None: the server's default)
    bind_chunk: int | None = None
    #: how long a renewal whose node row is held is sent again before the full path
    #: (GPUCLOUD_LEASE_BUSY_LIMIT, api/lease_capacity.py; 0: at once; None: the default)
    lease_busy_s: float | None = None
    #: the renewals a second the fleet may send before its TTL grows
    #: (GPUCLOUD_LEASE_RATE, services/lease_ttl.py; None: the server's default)
    lease_rate: float | None = None
    #: the long polls a second the fleet may send before its poll wait grows
    #: (GPUCLOUD_POLL_RATE, services/lease_ttl.py; None: the server's default)
    poll_rate: float | None = None
    #: the replicas' worker threads for blocking work (GPUCLOUD_REQUEST_THREADS; None:
    #: the server's, 10)
    request_threads: int | None = None

    def expected_ttl(self) -> float:
        """The TTL the server grants this fleet once it is registered (lease_ttl.py)."""
        return lease_ttl.fleet_ttl(self.ttl, self.agents, self.lease_rate or lease_ttl.RATE)

    def server_env(self) -> dict[str, str]:
        """The replicas' environment for this plan's server knobs."""
        env = {}
        if self.bind_chunk is not None:
            env["GPUCLOUD_BIND_CHUNK"] = str(self.bind_chunk)
        if self.lease_busy_s is not None:
            env["GPUCLOUD_LEASE_BUSY_LIMIT"] = str(self.lease_busy_s)
        if self.lease_rate is not None:
            env["GPUCLOUD_LEASE_RATE"] = str(self.lease_rate)
        if self.poll_rate is not None:
            env["GPUCLOUD_POLL_RATE"] = str(self.poll_rate)
        if self.request_threads is not None:
            env["GPUCLOUD_REQUEST_THREADS"] = str(self.request_threads)
        return env


def _summed(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for one in counts:
        for key, n in one.items():
            total[key] = total.get(key, 0) + n
    return total


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


#: The deployments ``--topology`` compares: (name, runs the controllers, takes agents) per
#: replica, in their start order (the first migrates and takes the controllers' lease).
TOPOLOGIES = {
    # every replica does everything: the leader answers its share of the agents too
    "shared": [("a", True, True), ("b", True, True)],
    # the controllers apart (a leader and its standby, as kube-scheduler runs apart from
    # the apiservers): the agents and API clients reach only the --no-controllers replicas
    "split": [("c", True, False), ("d", True, False), ("a", False, True),
              ("b", False, True)],
}


@contextmanager
def _cluster(plan: Plan) -> Iterator[tuple[str, list[Replica]]]:
    with postgres_server(durable=False) as database_url:
        replicas = [Replica(name, database_url, plan.ttl, plan.server_workers, controllers,
                            agents, plan.server_env())
                    for name, controllers, agents in TOPOLOGIES[plan.topology]]
        try:
            for replica in replicas:  # the first migrates and takes the lease: the leader
                replica.start()
            yield database_url, replicas
        finally:
            for replica in replicas:
                replica.stop()


def run(plan: Plan) -> dict[str, Any]:
    prefix = f"fleet{int(time.time()) % 100000}"
    with _cluster(plan) as (database_url, replicas):
        ports = [r.port for r in replicas if r.agents]
        join_token = _admin(replicas[0].url, "POST", "/v1/nodes/join-tokens", {})["token"]
        monitor = Monitor(database_url, prefix)
        monitor.start()
        started = time.time()
        workers = Workers(plan.agents, plan.processes, ports, join_token, prefix,
                          plan.ramp_s)
        try:
            with _ramp_profiled(plan, replicas, workers) as ramp_profiles:
                workers.wait_registered(timeout=plan.ramp_s + 600, usage=_usage_meter(
                    replicas, workers, database_url, monitor))
            registered_s = time.time() - started
            print(f"{plan.agents} agents registered in {registered_s:.1f} s", flush=True)
            t0, cpu0 = time.time(), [r.cpu() for r in replicas] + [workers.cpu()]
            pg0 = postgres_cpu_seconds(database_url)
            if plan.backlog:
                timeline = _drive_backlog(plan, replicas, ports, workers, monitor)
            else:
                with _profiled(plan, replicas, workers) as profiles:
                    timeline = _drive(plan, replicas, ports, workers, monitor)
                timeline["profiles"] = profiles
            if ramp_profiles:
                timeline["profiles_ramp"] = ramp_profiles
            elapsed = time.time() - t0
            cpu = [(r.cpu() - c) / elapsed for r, c in zip(replicas, cpu0, strict=False)]
            agent_cpu = (workers.cpu() - cpu0[-1]) / elapsed
            timeline["postgres_cpu_cores"] = round(
                (postgres_cpu_seconds(database_url) - pg0) / elapsed, 2)
            _trace_false_lost(workers, monitor, timeline)
            workers.send("stop")
            workers.wait_for("stats", len(workers.procs), timeout=60)
        finally:
            monitor.stop.set()
            workers.close()
        monitor.join(timeout=5)
        return _summarize(plan, workers, monitor, timeline, elapsed, cpu, agent_cpu,
                          registered_s)


def _usage_meter(replicas: list[Replica], workers: Workers, database_url: str,
                 monitor: Monitor) -> Callable[[], str]:
    """A function that says the cores each part used since its last call (the replicas,
    PostgreSQL, the agent workers), the load average, the renewals a second and what
    PostgreSQL's active sessions were doing most meanwhile."""
    def sample() -> tuple[float, list[float], int]:
        return (time.monotonic(), [r.cpu() for r in replicas]
                + [postgres_cpu_seconds(database_url), workers.cpu()],
                workers.progress("renewals"))

    waits = [dict(monitor.waits)]

    last = [sample()]

    def usage() -> str:
        now = sample()
        (t0, cpu0, renewed0), (t1, cpu1, renewed1) = last[0], now
        last[0] = now
        names = [r.name for r in replicas] + ["pg", "agents"]
        cores = " ".join(f"{n} {(b - a) / (t1 - t0):.2f}"
                         for n, a, b in zip(names, cpu0, cpu1, strict=True))
        now_waits = dict(monitor.waits)
        top = sorted(((n - waits[0].get(k, 0), k) for k, n in now_waits.items()),
                     reverse=True)[:3]
        waits[0] = now_waits
        return (f"cores: {cores}; load {os.getloadavg()[0]:.1f};"
                f" renewals/s {(renewed1 - renewed0) / (t1 - t0):.0f}; pg active: "
                + ", ".join(f"{k} x{n}" for n, k in top if n > 0))

    return usage


def _drive(plan: Plan, replicas: list[Replica], ports: list[int], workers: Workers,
           monitor: Monitor) -> dict[str, Any]:
    """Pods in two waves, the leader's kill between them, then 1 % of the agents killed."""
    end = time.time() + plan.duration
    timeline: dict[str, Any] = {}
    seconds, errors, codes = asyncio.run(_create_pods(ports, 0, plan.pods // 2, 32))
    timeline["wave1"] = {"pods": plan.pods // 2, "create_s": round(seconds, 2),
                         "errors": errors, "error_codes": codes}
    print(f"wave 1: {plan.pods // 2} pods created in {seconds:.1f} s ({errors} errors)",
          flush=True)
    _sleep_until(time.time() + plan.duration * 0.2, end)
    leader = replicas[0]  # started first: it took the controllers' lease
    killed_at = time.time()
    leader_before = monitor.leader[-1] if monitor.leader else (0, None, None)
    leader.kill()
    timeline["leader_killed_at"] = killed_at
    seconds, errors, codes = asyncio.run(_create_pods(ports, plan.pods // 2,
                                                       plan.pods - plan.pods // 2, 32))
    timeline["wave2"] = {"pods": plan.pods - plan.pods // 2, "create_s": round(seconds, 2),
                         "errors": errors, "error_codes": codes}
    print(f"leader killed; wave 2: {plan.pods - plan.pods // 2} pods created in"
          f" {seconds:.1f} s ({errors} errors)", flush=True)
    leader.start()  # back as a follower
    timeline["failover_s"] = _failover_seconds(monitor, killed_at, leader_before[1])
    print(f"failover: {timeline['failover_s']} s", flush=True)
    _sleep_until(time.time() + plan.duration * 0.2, end)
    _trace_false_lost(workers, monitor, timeline)  # the failover's, while still in history
    kills = max(1, plan.agents // 100)
    per = -(-kills // len(workers.procs))
    workers.send(f"kill {per}")
    workers.wait_for("killed", len(workers.procs), timeout=30)
    print(f"{per * len(workers.procs)} agents killed; waiting"
          f" {max(end - time.time(), plan.expected_ttl() + 5):.0f} s for their loss", flush=True)
    # however long the waves took, the kills get TTL + 2 s (and a margin) to be detected
    time.sleep(max(end - time.time(), plan.expected_ttl() + 5))
    return timeline


def _trace_false_lost(workers: Workers, monitor: Monitor, timeline: dict[str, Any]) -> None:
    # (called before the kills, for the failover, and at the end: the history holds
    # about the last 200 s of each agent; a node traced already keeps its first trace)
    """Each node Lost while its agent was alive: its agent's last lease attempts (which
    replica, the answer, how long it took) and the server's last renewal, in seconds from
    the leader's kill, into bench/results/fleet-false-lost.json."""
    killed = {name: m["at"] for m in workers.of("killed") for name in m["names"]}
    names = sorted(n for n, times in monitor.entries.items()
                   if n not in killed or min(times) < killed[n])
    traces: dict[str, Any] = timeline.setdefault("false_lost_traces", {})
    names = [n for n in names if n not in traces]
    if not names:
        return
    # and, to compare, a few agents that were never Lost (both replicas' first agents)
    prefix = names[0].rsplit("-", 1)[0]
    alive = [f"{prefix}-{i}" for i in range(0, 1000, 37)
             if f"{prefix}-{i}" not in monitor.entries and f"alive {prefix}-{i}" not in traces]
    asked = len(workers.of("trace"))
    workers.send("trace " + " ".join(names + alive))
    workers.wait_for("trace", asked + len(workers.procs), timeout=60)
    zero = timeline.get("leader_killed_at") or 0.0
    for message in workers.of("trace")[asked:]:
        for name, history in message["agents"].items():
            renewed = monitor.lost_renewed.get(name)
            if name not in monitor.entries:
                traces[f"alive {name}"] = [[round(t - zero, 2), port, status, round(took, 3),
                                            note] for t, port, status, took, note in history]
                continue
            traces[name] = {
                "lost_s": [round(t - zero, 2) for t in monitor.entries[name]],
                "server_last_renewed_s": None if renewed is None else round(renewed - zero, 2),
                "attempts": [[round(t - zero, 2), port, status, round(took, 3), note]
                             for t, port, status, took, note in history
                             if t > min(monitor.entries[name]) - 60]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fleet-false-lost.json").write_text(json.dumps(traces, indent=1) + "\n")


#: The holder the bench writes into the controllers' lease to pause scheduling.
PAUSE_HOLDER = "fleet-bench:scheduling-paused"


def _pause_scheduling(engine: sa.Engine) -> None:
    """Pause the controllers the way a leader change does: the bench takes their lease
    (a new epoch, held for an hour by a holder that runs nothing), so the leader's next
    write fails its fence (services/leadership.py) and neither replica leads."""
    with engine.begin() as db:
        db.execute(sa.text(
            "UPDATE controller_leases SET holder = :h, token = token + 1,"
            " expires_at = now() + interval '1 hour' WHERE name = 'controllers'"),
            {"h": PAUSE_HOLDER})


def _release_scheduling(engine: sa.Engine) -> None:
    """Let the lease lapse now: a replica takes it over at its next try (TTL/3 at most)."""
    with engine.begin() as db:
        db.execute(sa.text("UPDATE controller_leases SET expires_at = now()"
                           " WHERE name = 'controllers' AND holder = :h"), {"h": PAUSE_HOLDER})


def _leader_replica(monitor: Monitor, replicas: list[Replica], since: float,
                    timeout: float = 60.0) -> Replica | None:
    """The replica whose process holds the controllers' lease after ``since`` (the holder
    names its pid, leadership.new_holder)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for t, holder, _ in reversed(monitor.leader):
            if t < since:
                break
            for replica in replicas:
                if holder and replica.process and f":{replica.process.pid}:" in holder:
                    return replica
        time.sleep(0.1)
    return None


def _pass_metrics(replica: Replica, tries: int = 3) -> tuple[float, float] | None:
    """(passes, seconds in them) from the replica's /metrics (this process's counters);
    None when no scrape answered (a busy replica's /metrics can time out: read as 0, the
    delta over a drain came out negative)."""
    for _ in range(tries):
        with suppress(httpx.HTTPError):
            response = httpx.get(f"{replica.url}/metrics", timeout=10)
            if response.status_code != 200:
                continue
            count = total = 0.0
            for line in response.text.splitlines():
                if line.startswith("gpucloud_scheduler_pass_duration_seconds_count"):
                    count = float(line.split()[-1])
                elif line.startswith("gpucloud_scheduler_pass_duration_seconds_sum"):
                    total = float(line.split()[-1])
            return count, total
    return None


def pass_delta(before: tuple[float, float] | None, after: tuple[float, float] | None
               ) -> dict[str, Any] | None:
    """The passes (count, seconds) between two scrapes of one replica: None where either
    scrape failed or the counters went back (the process restarted), never negative."""
    if before is None or after is None:
        return None
    count, seconds = after[0] - before[0], after[1] - before[1]
    if count < 0 or seconds < 0:
        return None
    return {"count": int(count), "seconds": round(seconds, 2)}


def _profilers(replicas: list[Replica], workers: Workers, tag: str) -> list[Any]:
    """py-spy on each replica and on the first agent worker (bench/pyspy.py)."""
    if not pyspy.available():
        print("no py-spy: no profile (.venv/bin/pip install py-spy)", flush=True)
        return []
    folder = Path(tempfile.mkdtemp(prefix="gpucloud-fleet-profile-"))
    targets = [(f"replica-{r.name}", r.process.pid) for r in replicas if r.process]
    targets.append(("agent-worker-0", workers.procs[0].pid))
    return [(name, pyspy.Profiler(pid, folder / f"{tag}-{name}.raw").start())
            for name, pid in targets]


def _profiles(profilers: list[Any]) -> dict[str, Any]:
    return {name: profiler.stop() for name, profiler in profilers}


@contextmanager
def _ramp_profiled(plan: Plan, replicas: list[Replica], workers: Workers
                   ) -> Iterator[dict[str, Any]]:
    """Profiles of the registrations' ramp (``plan.profile_s``, else the whole ramp:
    while the fleet registers); written to RESULTS/fleet-ramp-profile.json as well, so
    that a ramp which does not finish still leaves its profile."""
    found: dict[str, Any] = {}
    if not plan.profile_s:
        yield found
        return
    profilers = _profilers(replicas, workers, "ramp")
    try:
        yield found
    finally:
        found.update(_profiles(profilers))
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "fleet-ramp-profile.json").write_text(json.dumps(found, indent=1) + "\n")


@contextmanager
def _profiled(plan: Plan, replicas: list[Replica], workers: Workers
              ) -> Iterator[dict[str, Any]]:
    """Profiles for ``plan.profile_s`` seconds from 10 % into the run (before the leader's
    kill at 20 %), taken on a thread of their own while the run goes on."""
    found: dict[str, Any] = {}
    if not plan.profile_s:
        yield found
        return

    def record() -> None:
        time.sleep(plan.duration * 0.1)
        profilers = _profilers(replicas, workers, "steady")
        time.sleep(plan.profile_s)
        found.update(_profiles(profilers))

    thread = threading.Thread(target=record, daemon=True)
    thread.start()
    yield found
    thread.join(timeout=plan.profile_s + 60)


def _drive_backlog(plan: Plan, replicas: list[Replica], ports: list[int], workers: Workers,
                   monitor: Monitor) -> dict[str, Any]:
    """A backlog, then its drain: scheduling paused (``_pause_scheduling``), ``backlog``
    pods created through the API, scheduling released; measured until every one is bound
    (Pending -> bound through the real controllers and database, 10,000 nodes' agents
    renewing and long-polling meanwhile, and reporting their pods Running)."""
    timeline: dict[str, Any] = {}
    _pause_scheduling(monitor.engine)
    time.sleep(2.0)  # a pass in flight ends on its fence
    bound_before = monitor.samples[-1][2] if monitor.samples else 0
    seconds, errors, codes = asyncio.run(_create_pods(ports, 0, plan.backlog, 32))
    created = plan.backlog - errors
    timeline["backlog_create"] = {"pods": plan.backlog, "create_s": round(seconds, 2),
                                  "creates_per_s": round(plan.backlog / seconds, 1),
                                  "errors": errors, "error_codes": codes}
    print(f"backlog: {created} pods created in {seconds:.1f} s; releasing", flush=True)
    profilers = _profilers(replicas, workers, "drain") if plan.profile_s else []
    cpu0 = [r.cpu() for r in replicas] + [workers.cpu()]
    passes0 = [_pass_metrics(r) for r in replicas]
    released = time.time()
    _release_scheduling(monitor.engine)
    leader = _leader_replica(monitor, replicas, released)
    deadline = time.time() + max(300.0, plan.duration)
    while time.time() < deadline and (
            not monitor.samples or monitor.samples[-1][2] < bound_before + created):
        time.sleep(0.25)
    done = time.time()
    cpu = [(c1 - c0) / (done - released) for c0, c1 in
           zip(cpu0, [r.cpu() for r in replicas] + [workers.cpu()], strict=True)]
    passes = [pass_delta(p0, _pass_metrics(r)) for p0, r in zip(passes0, replicas,
                                                                 strict=True)]
    timeline["profiles"] = _profiles(profilers)
    timeline["backlog"] = _drain_figures(monitor, released, bound_before, created) | {
        "leader": leader.name if leader else None,
        "cpu_cores_during_drain": {f"replica_{r.name}": round(c, 2) for r, c in
                                   zip(replicas, cpu, strict=False)}
                                  | {"agent_workers": round(cpu[-1], 2)},
        "leader_cpu_cores": (round(cpu[replicas.index(leader)], 2) if leader else None),
        # None: a scrape failed (unknown), omitted: no pass on that replica
        "passes": {r.name: p for r, p in zip(replicas, passes, strict=True)
                   if p is None or p["count"]},
    }
    time.sleep(5)  # the agents' reports of the last pods
    return timeline


def _drain_figures(monitor: Monitor, released: float, bound_before: int,
                   created: int) -> dict[str, Any]:
    """From the monitor's samples: when the first pod was bound after the release, when
    the last, and the rate in between (and with the takeover's wait included)."""
    drain = [(t, b - bound_before) for t, _, b in monitor.samples if t >= released]
    started = next((t for t, b in drain if b > 0), None)
    finished = next((t for t, b in drain if b >= created), None)
    bound = drain[-1][1] if drain else 0
    out: dict[str, Any] = {"pods": created, "bound": bound,
                           "takeover_to_first_bind_s": (round(started - released, 2)
                                                        if started else None)}
    # of which: until a replica held the lease again (its next try: within TTL/3), and
    # from then to the first bind (its new epoch's work, the first pass's snapshot)
    led = next((t for t, holder, _ in monitor.leader
                if t >= released and holder and holder != PAUSE_HOLDER), None)
    out["release_to_leader_s"] = round(led - released, 2) if led else None
    if led and started:
        out["leader_to_first_bind_s"] = round(started - led, 2)
    if started and finished and finished > started:
        # the first sample with binds is already into the drain: count from the sample
        # before it (binds commit per chunk, _BIND_CHUNK pods, so the edges are coarse)
        before = max((t for t, b in drain if b == 0), default=released)
        out["drain_s"] = round(finished - before, 2)
        out["pods_per_s"] = round(created / (finished - before), 1)
        out["pods_per_s_incl_takeover"] = round(created / (finished - released), 1)
        _, best = _throughput([(t, created - b, b) for t, b in drain])
        out["best_1s_pods_per_s"] = round(best, 1)
    return out


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
    # the TTL the agents were granted (the fleet's: longer than --ttl for a large fleet)
    granted_ttl = max([plan.ttl, *(s.get("ttl_max_s", 0.0) for s in stats)])
    return {
        "mode": "quick" if plan.quick else "full",
        "agents": plan.agents, "agent_processes": plan.processes,
        "topology": plan.topology, "replicas": len(TOPOLOGIES[plan.topology]),
        "bind_chunk": plan.bind_chunk, "lease_busy_limit_s": plan.lease_busy_s,
        "server_workers_per_replica": plan.server_workers,
        "lease_ttl_s": plan.ttl, "lease_ttl_granted_s": granted_ttl,
        "lease_rate": plan.lease_rate, "poll_rate": plan.poll_rate,
        "request_threads": plan.request_threads,
        "long_polls": sum(s.get("polls", 0) for s in stats),
        "poll_wait_max_s": max((s.get("poll_wait_max_s", 0.0) for s in stats), default=0.0),
        "measured_s": round(elapsed, 1),
        "register_all_s": round(registered_s, 1), "register_ramp_s": plan.ramp_s,
        "register_retries": sum(s["register_retries"] for s in stats),
        "register_error_codes": _summed(s.get("register_error_codes", {}) for s in stats),
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
        "detection_within_ttl_plus_2": sum(d <= granted_ttl + 2
                                           for d in detection.values()),
        "undetected": undetected[:20],
        "pods": plan.pods,
        "pods_bound": monitor.samples[-1][2] if monitor.samples else 0,
        "pods_reported_running": sum(s["reports"] for s in stats),
        "scheduling_pods_per_s": round(rate, 1),
        "scheduling_best_1s_pods_per_s": round(best, 1),
        "scheduling_pods_per_s_backlog_256": round(behind, 1),
        "leader_failover_s": timeline.get("failover_s"),
        "cpu_cores_per_replica": {name: round(c, 2) for (name, *_), c in
                                  zip(TOPOLOGIES[plan.topology], cpu, strict=True)},
        "cpu_cores_agent_workers": round(agent_cpu, 2),
        "cpu_cores_postgres": timeline.get("postgres_cpu_cores"),
        "load_average_1m": round(os.getloadavg()[0], 1),
        "machine_cores": os.cpu_count(),
        "waves": {"1": timeline.get("wave1"), "2": timeline.get("wave2")},
        "postgres_active_waits": dict(sorted(monitor.waits.items(),
                                             key=lambda kv: -kv[1])[:12]),
        "postgres_lock_waits_behind": dict(sorted(monitor.blocked.items(),
                                                  key=lambda kv: -kv[1])[:12]),
    } | {key: timeline[key] for key in ("backlog_create", "backlog", "profiles",
                                        "profiles_ramp")
         if key in timeline}


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
    parser.add_argument("--backlog", type=int, default=0,
                        help="create this many pods while scheduling is paused, release, "
                        "and measure their drain (instead of the waves and kills)")
    parser.add_argument("--profile", type=float, default=0.0, metavar="SECONDS",
                        help="py-spy profiles of the replicas and an agent worker: the "
                        "drain of --backlog, else SECONDS from 10 %% into the run")
    parser.add_argument("--ramp", type=float, metavar="SECONDS",
                        help="the agents register at random times within SECONDS "
                        "(default: agents / 100, as a fleet booting over minutes)")
    parser.add_argument("--topology", choices=sorted(TOPOLOGIES), default="shared",
                        help="shared: 2 replicas, each runs the controllers and takes "
                        "agents; split: the agents on 2 --no-controllers replicas, the "
                        "controllers on 2 others (a leader and a standby)")
    parser.add_argument("--bind-chunk", type=int, metavar="PODS",
                        help="pods the scheduler binds per transaction (the replicas' "
                        "GPUCLOUD_BIND_CHUNK; default: the server's)")
    parser.add_argument("--lease-busy-limit", type=float, metavar="SECONDS",
                        help="how long a renewal whose node row is held is sent again "
                        "before the full path (GPUCLOUD_LEASE_BUSY_LIMIT; 0: at once)")
    parser.add_argument("--lease-rate", type=float, metavar="PER_S",
                        help="renewals a second the fleet may send before the server "
                        "lengthens its lease TTL (GPUCLOUD_LEASE_RATE; default: the "
                        "server's, 1,000)")
    parser.add_argument("--poll-rate", type=float, metavar="PER_S",
                        help="long polls a second the fleet may send before the server "
                        "asks for longer waits (GPUCLOUD_POLL_RATE; default: the "
                        "server's, 200; 1000000: never)")
    parser.add_argument("--request-threads", type=int, metavar="N",
                        help="the replicas' worker threads for blocking work "
                        "(GPUCLOUD_REQUEST_THREADS; default: the server's, 10)")
    parser.add_argument("--variants", metavar="V1,V2,...",
                        help="run the bench once per variant named, in this order (a "
                        "name may repeat: shared,split,shared,split), each on a fresh "
                        "cluster, and compare them as ratios to the first "
                        "(bench/results/fleet-variants.json); a variant is a topology, "
                        "with :bind=PODS for its bind chunk and :busy=S for its lease "
                        "busy limit, :threads=N for its request threads "
                        "(shared:bind=1000:busy=0,shared:bind=250,shared:threads=10)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # stopped (timeout, kill): unwind, so that the replicas and PostgreSQL are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.worker:
        asyncio.run(_worker(json.loads(args.worker)))
        return
    quick = args.quick
    plan = Plan(agents=args.agents or (1000 if quick else 10_000),
                processes=args.processes or (2 if quick else 8),
                duration=args.duration or (600.0 if quick else 1800.0), ttl=args.ttl,
                pods=args.pods or (2000 if quick else 20_000), quick=quick,
                server_workers=args.server_workers, backlog=args.backlog,
                profile_s=args.profile, bind_chunk=args.bind_chunk,
                lease_busy_s=args.lease_busy_limit, lease_rate=args.lease_rate,
                poll_rate=args.poll_rate, request_threads=args.request_threads)
    plan.ramp_s = plan.agents / 100 if args.ramp is None else args.ramp
    if args.variants:
        _run_variants(plan, args.variants.split(","))
        return
    plan.topology = args.topology
    result = run(plan)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("fleet-backlog.json" if plan.backlog else "fleet.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    for key, value in result.items():
        print(f"{key:>32}: {value}")


#: What ``--variants`` compares, as (label, path into a run's result).
_COMPARED = [("pods_per_s_from_release", ("backlog", "pods_per_s_incl_takeover")),
             ("pods_per_s_from_first_bind", ("backlog", "pods_per_s")),
             ("takeover_to_first_bind_s", ("backlog", "takeover_to_first_bind_s")),
             ("release_to_leader_s", ("backlog", "release_to_leader_s")),
             ("leader_to_first_bind_s", ("backlog", "leader_to_first_bind_s")),
             ("leader_cpu_cores", ("backlog", "leader_cpu_cores")),
             ("scheduling_pods_per_s", ("scheduling_pods_per_s",)),
             ("renewal_p99_ms", ("renewal_p99_ms",)),
             ("false_lost", ("false_lost",))]


def _figure(result: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = result
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def variant_plan(plan: Plan, variant: str) -> Plan:
    """``plan`` for a variant: a topology, then optionally ``:PODS`` or ``:bind=PODS``
    (its bind chunk) and ``:busy=S`` (its lease busy limit): ``shared:bind=250:busy=0``."""
    topology, *knobs = variant.split(":")
    if topology not in TOPOLOGIES:
        raise SystemExit(f"unknown topology {topology!r} in variant {variant!r}")
    out = replace(plan, topology=topology)
    for knob in knobs:
        name, _, value = knob.rpartition("=")
        try:
            if name in ("", "bind") and int(value) > 0:
                out = replace(out, bind_chunk=int(value))
            elif name == "busy" and float(value) >= 0:
                out = replace(out, lease_busy_s=float(value))
            elif name == "rate" and float(value) > 0:
                out = replace(out, lease_rate=float(value))
            elif name == "poll" and float(value) > 0:
                out = replace(out, poll_rate=float(value))
            elif name == "threads" and int(value) > 1:
                out = replace(out, request_threads=int(value))
            else:
                raise ValueError(knob)
        except ValueError:
            raise SystemExit(f"bad knob {knob!r} in variant {variant!r}") from None
    return out


def _run_variants(plan: Plan, topologies: list[str]) -> None:
    """One run per variant named (fresh cluster each, the same plan otherwise), then
    each figure of ``_COMPARED`` per run, the mean per variant and its ratio to the
    first variant's: runs back to back share the machine's load of the moment, so
    ratios hold where absolute figures on a shared machine do not."""
    plans = [variant_plan(plan, variant) for variant in topologies]
    runs: list[dict[str, Any]] = []
    for variant, one in zip(topologies, plans, strict=True):
        print(f"-- variant {variant} ({len(runs) + 1}/{len(topologies)})", flush=True)
        started = time.time()
        result = run(one)
        result["variant"] = variant
        result["load_average"] = os.getloadavg()[0]
        result["wall_s"] = round(time.time() - started, 1)
        runs.append(result)
        print(f"-- variant {variant}: " + ", ".join(  # as it ends: a cut run keeps it
            f"{label} {_figure(result, path)}" for label, path in _COMPARED), flush=True)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "fleet-variants.json").write_text(json.dumps({"runs": runs}) + "\n")
    means: dict[str, dict[str, float | None]] = {}
    for topology in dict.fromkeys(topologies):
        of = [r for r in runs if r["variant"] == topology]
        means[topology] = {}
        for label, path in _COMPARED:
            values = [v for r in of if (v := _figure(r, path)) is not None]
            means[topology][label] = round(sum(values) / len(values), 2) if values else None
    base = means[topologies[0]]
    ratios = {t: {label: (round(v / b, 2) if v is not None and (b := base[label]) else None)
                  for label, v in m.items()} for t, m in means.items()}
    out = {"variants": topologies, "means": means, f"ratios_to_{topologies[0]}": ratios,
           "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fleet-variants.json").write_text(json.dumps(out, indent=2) + "\n")
    for topology, figures in means.items():
        print(f"{topology:>8}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    for topology, figures in ratios.items():
        print(f"{topology:>8} / {topologies[0]}: "
              + ", ".join(f"{k} {v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
