"""Benchmark: replica CPU per agent request (registration, lease renewal, long poll).

Starts one ``gpucloud server`` (controllers running) on a fresh PostgreSQL per variant and
drives it from this process over keep-alive connections (bench/fleet.py's raw client):
``--nodes`` registrations ``--clients`` at a time (with ``--unschedulable`` pods that fit
nowhere waiting, as a fleet's backlog does while it registers), then ``--rounds``
renewals of every node, then as many long polls that wait ``--poll-wait`` seconds on an
unchanged revision and end with the answer kept for it (a fleet's polls end so). Prints,
per variant, the server's CPU milliseconds per request of each kind and the rate.

``--variants name=SRC,...`` runs the server from another source tree (its ``src``
directory on ``PYTHONPATH``), e.g. the last commit unpacked with
``git archive HEAD src | tar -x -C /tmp/base``: old and new side by side in one run.

    .venv/bin/python bench/agent_routes.py [--nodes 400] [--rounds 5] \
        [--variants base=/tmp/base/src,new=src]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import pyspy  # noqa: E402
from bench.fleet import GIB, Http, agent_address, cpu_seconds  # noqa: E402
from tests.fixtures.postgres import free_port, postgres_server  # noqa: E402

ADMIN_KEY = "gpc_agent-routes-bench-admin-key"
RESULTS = ROOT / "bench" / "results"


@contextmanager
def server(database_url: str, src: Path) -> Iterator[tuple[int, int]]:
    """``gpucloud server`` from source tree ``src``; yields its port and pid."""
    home = Path(tempfile.mkdtemp(prefix="gpucloud-agent-routes-"))
    port = free_port()
    env = {**os.environ, "GPUCLOUD_HOME": str(home), "GPUCLOUD_ADMIN_KEY": ADMIN_KEY,
           "GPUCLOUD_DATABASE_URL": database_url, "GPUCLOUD_LEASE_TTL": "60",
           "PYTHONPATH": str(src.resolve())}
    with open(home / "stderr.log", "ab") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "gpucloud.cli.main", "server", "--port", str(port),
             "--ssh-port", "0"], env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((home / "stderr.log").read_text()[-2000:])
            with suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).is_success:
                    break
            time.sleep(0.2)
        yield port, process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)


def _admin(port: int, method: str, path: str, body: object | None = None) -> Any:
    response = httpx.request(method, f"http://127.0.0.1:{port}{path}", json=body, timeout=60,
                             headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    response.raise_for_status()
    return response.json()


class Node:
    """One simulated agent: its connection (from an address of its own) and its grant."""

    def __init__(self, port: int, index: int) -> None:
        self.index = index
        self.http = Http([port], 0, agent_address(index))
        self.token, self.fencing, self.revision = "", 0, 0

    async def register(self, join_token: str) -> int:
        gpus = [{"uuid": f"GPU-n{self.index}-{i}", "model": "H100 80GB", "memory_mib": 81559,
                 "index": i} for i in range(8)]
        status, out = await self.http.request("POST", "/v1/agent/register", None, {
            "join_token": join_token, "name": f"bench-{self.index}", "cpu_cores": 128,
            "memory_bytes": 1024 * GIB, "gpus": gpus}, timeout=60)
        if status == 201:
            self.token, self.fencing = out["node_token"], out["fencing_token"]
        return status

    async def renew(self) -> int:
        status, out = await self.http.request("POST", "/v1/agent/lease", self.token,
                                              {"fencing_token": self.fencing})
        if status == 200:
            self.fencing = out["fencing_token"]
        return status

    async def poll(self, wait: float) -> int:
        status, out = await self.http.request(
            "GET", f"/v1/agent/assignments?wait={wait}&revision={self.revision}", self.token)
        if status == 200:
            self.revision = out["revision"]
        return status


async def _phase(pid: int, nodes: list[Node], clients: int, rounds: int,
                 step: Callable[[Node], Awaitable[int]], ok: int,
                 profile: Path | None = None) -> dict[str, Any]:
    """Every node does ``step`` ``rounds`` times, ``clients`` nodes at a time: the server's
    CPU per request and the rate (``profile``: py-spy's recording of it there)."""
    shards = [nodes[i::clients] for i in range(clients)]
    errors: dict[str, int] = {}

    async def client(shard: list[Node]) -> None:
        for _ in range(rounds):
            for node in shard:
                status = await step(node)
                if status != ok:
                    errors[str(status)] = errors.get(str(status), 0) + 1

    profiler = pyspy.Profiler(pid, profile, rate=200).start() if profile else None
    cpu0, wall0 = cpu_seconds(pid), time.perf_counter()
    await asyncio.gather(*(client(shard) for shard in shards))
    cpu, wall = cpu_seconds(pid) - cpu0, time.perf_counter() - wall0
    requests = len(nodes) * rounds
    out: dict[str, Any] = {"requests": requests, "per_s": round(requests / wall, 1),
                           "cpu_ms": round(cpu * 1000 / requests, 3),
                           "errors": sum(errors.values())}
    if errors:
        out["codes"] = errors
    if profiler is not None:
        out["profile"] = profiler.stop(top=30)
    return out


def run_variant(name: str, src: Path, args: argparse.Namespace) -> dict[str, Any]:
    with postgres_server() as url, server(url, src) as (port, pid):
        for n in range(args.unschedulable):  # 16 GPUs: fits no node (8 each)
            _admin(port, "POST", "/v1/pods", {"name": f"big-{n}", "image": "busybox:1",
                                              "gpus": 16})
        join = _admin(port, "POST", "/v1/nodes/join-tokens", {})["token"]
        nodes = [Node(port, i) for i in range(args.nodes)]

        def profile(kind: str) -> Path | None:
            return Path(args.profile) / f"{name}-{kind}.raw" if args.profile else None

        async def drive() -> dict[str, Any]:
            out: dict[str, Any] = {}
            out["register"] = await _phase(pid, nodes, args.clients, 1,
                                           lambda node: node.register(join), 201,
                                           profile("register"))
            for node in nodes:  # the revision the answers are kept for
                await node.poll(0)
            await _phase(pid, nodes, args.clients, 1, Node.renew, 200)  # warm-up
            out["lease"] = await _phase(pid, nodes, args.clients, args.rounds, Node.renew, 200,
                                        profile("lease"))
            out["poll"] = await _phase(pid, nodes, args.clients, args.rounds,
                                       lambda node: node.poll(args.poll_wait), 200,
                                       profile("poll"))
            for node in nodes:
                node.http._drop()
            return out

        return asyncio.run(drive())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=400)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--unschedulable", type=int, default=20)
    parser.add_argument("--poll-wait", type=float, default=0.05)
    parser.add_argument("--variants", default="current=src", metavar="NAME=SRC,...")
    parser.add_argument("--profile", metavar="DIR", help="py-spy each phase into DIR")
    args = parser.parse_args()
    # ``timeout``'s TERM unwinds the servers and PostgreSQL as the end of a run does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict[str, Any] = {"loadavg": Path("/proc/loadavg").read_text().split()[:3]}
    for variant in args.variants.split(","):
        name, _, src = variant.partition("=")
        load = Path("/proc/loadavg").read_text().split()[:3]
        print(f"-- {name} ({src}), load {' '.join(load)}", flush=True)
        results[name] = figures = run_variant(
            name, ROOT / src if not src.startswith("/") else Path(src), args)
        figures["loadavg"] = load
        for kind, figure in figures.items():
            if not isinstance(figure, dict):
                continue
            shown = {k: v for k, v in figure.items() if k != "profile"}
            print(f"{name:>10} {kind:>8}: {json.dumps(shown)}", flush=True)
    results["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "agent_routes.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
