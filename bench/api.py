"""Benchmark: pod creation through the REST API, on SQLite and on PostgreSQL.

Starts ``gpucloud server`` as its own process (controllers running, as in production) and
drives ``POST /v1/pods`` from this process with concurrent keep-alive clients written on
raw asyncio streams, so the load generator costs little CPU next to the server on a small
machine. Prints creates/s and p50/p99 latency per database; JSON to bench/results/api.json.

    .venv/bin/python bench/api.py [--pods 5000] [--clients 32] [--backends sqlite,postgresql]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.postgres import free_port, postgres_server  # noqa: E402

ADMIN_KEY = "gpc_bench-admin-key"
RESULTS = ROOT / "bench" / "results"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its children (server workers), from /proc."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(c) for c in children.read_text().split()]
    for one in pids:
        try:
            fields = Path(f"/proc/{one}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


@contextmanager
def running_server(database_url: str | None, workers: int) -> Iterator[tuple[str, int]]:
    """``gpucloud server`` in a subprocess on a free port; yields its URL and pid."""
    home = Path(tempfile.mkdtemp(prefix="gpucloud-bench-"))
    env = {**os.environ, "GPUCLOUD_HOME": str(home), "GPUCLOUD_ADMIN_KEY": ADMIN_KEY}
    if database_url:
        env["GPUCLOUD_DATABASE_URL"] = database_url
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpucloud.cli.main",
            "server",
            "--port",
            str(port),
            "--workers",
            str(workers),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process)
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)


def _wait_healthy(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            err = process.stderr.read().decode(errors="replace") if process.stderr else ""
            raise RuntimeError(f"server exited: {err}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError("server did not become healthy")


class RawClient:
    """A minimal HTTP/1.1 keep-alive client: one connection, one request at a time."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def post(self, path: str, body: bytes) -> int:
        assert self.reader and self.writer
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {ADMIN_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        await self.reader.readexactly(length)
        return int(status_line.split()[1])

    async def close(self) -> None:
        if self.writer:
            self.writer.close()
            await self.writer.wait_closed()


async def _client_loop(
    port: int, names: list[str], latencies: list[float], errors: list[int]
) -> None:
    client = RawClient(port)
    await client.connect()
    try:
        for name in names:
            body = json.dumps(
                {
                    "name": name,
                    "image": "ghcr.io/acme/trainer:1",
                    "gpus": 1,
                    "command": ["python", "train.py"],
                }
            ).encode()
            started = time.perf_counter()
            status = await client.post("/v1/pods", body)
            latencies.append(time.perf_counter() - started)
            if status != 201:
                errors.append(status)
    finally:
        await client.close()


async def load(url: str, prefix: str, pods: int, clients: int) -> dict[str, float]:
    port = int(url.rsplit(":", 1)[1])
    names = [f"{prefix}-{i}" for i in range(pods)]
    shards = [names[i::clients] for i in range(clients)]
    latencies: list[float] = []
    errors: list[int] = []
    started = time.perf_counter()
    await asyncio.gather(*(_client_loop(port, shard, latencies, errors) for shard in shards))
    elapsed = time.perf_counter() - started
    ordered = sorted(latencies)
    return {
        "pods": pods,
        "clients": clients,
        "seconds": round(elapsed, 3),
        "creates_per_second": round(pods / elapsed, 1),
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(ordered[int(len(ordered) * 0.99) - 1] * 1000, 2),
        "errors": len(errors),
    }


def run_backend(backend: str, pods: int, clients: int, workers: int) -> dict[str, Any]:
    with _database(backend) as database_url, running_server(database_url, workers) as (url, pid):
        asyncio.run(load(url, "warmup", 300, clients))
        before = cpu_seconds(pid)
        result = asyncio.run(load(url, "pod", pods, clients))
        server_cpu_ms = (cpu_seconds(pid) - before) * 1000 / pods
    return {"backend": backend, "workers": workers, **result,
            "server_cpu_ms_per_create": round(server_cpu_ms, 3)}


@contextmanager
def _database(backend: str) -> Iterator[str | None]:
    if backend == "sqlite":
        yield None
    else:
        with postgres_server(durable=True) as url:
            yield url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=5000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--backends", default="sqlite,postgresql")
    args = parser.parse_args()
    results = [
        run_backend(b, args.pods, args.clients, args.workers) for b in args.backends.split(",")
    ]
    for r in results:
        print(
            f"{r['backend']:>10}: {r['creates_per_second']:8.1f} creates/s  "
            f"p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:6.2f} ms  errors {r['errors']}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "api.json"
    out.write_text(json.dumps({"benchmark": "api-pod-create", "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
