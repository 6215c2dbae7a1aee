"""Several `gpucloud server` replicas on one PostgreSQL, as real processes on loopback
ports, and a client that spreads requests over them round-robin (a load balancer)."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import psycopg

from tests.conftest import ADMIN_KEY
from tests.fixtures.postgres import _as_postgres, _bin, free_port, postgres_server
from tests.integration.conftest import h100_gpus


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@dataclass
class Replica:
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Cluster:
    database_url: str
    data_dir: Path
    pg_options: str
    replicas: list[Replica] = field(default_factory=list)
    _next: Iterator[int] = field(default_factory=itertools.count)

    @property
    def dsn(self) -> str:
        return self.database_url.replace("postgresql+psycopg://", "postgresql://")

    def sql(self, query: str, *params: object) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return list(conn.execute(query, params).fetchall())

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.process.poll() is None]

    def request(self, method: str, path: str, key: str = ADMIN_KEY,
                **kwargs: Any) -> httpx.Response:
        """One request to the next live replica (round-robin)."""
        live = self.live()
        replica = live[next(self._next) % len(live)]
        return self.on(replica, method, path, key, **kwargs)

    def on(self, replica: Replica, method: str, path: str, key: str = ADMIN_KEY,
           **kwargs: Any) -> httpx.Response:
        headers = kwargs.pop("headers", {"Authorization": f"Bearer {key}"})
        return httpx.request(method, replica.url + path, headers=headers, timeout=30,
                             **kwargs)

    def register_node(self, replica: Replica, name: str) -> dict[str, Any]:
        """A node of 8 H100s registered through ``replica`` with a fresh join token: its
        registration answer (node token, fencing token)."""
        join = self.on(replica, "POST", "/v1/nodes/join-tokens")
        assert join.status_code == 201, join.text
        response = self.on(replica, "POST", "/v1/agent/register", json={
            "join_token": join.json()["token"], "name": name, "cpu_cores": 64,
            "memory_bytes": 512 * 1024**3, "gpus": h100_gpus()})
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body

    def leader(self) -> tuple[Replica, int]:
        """The replica whose process holds the controllers' lease, and its epoch."""
        rows = self.sql("SELECT holder, token FROM controller_leases "
                        "WHERE name = 'controllers' AND expires_at > now()")
        assert rows, "no leader"
        pid = int(rows[0][0].split(":")[1])
        return next(r for r in self.replicas if r.process.pid == pid), int(rows[0][1])

    def kill(self, replica: Replica) -> None:
        replica.process.send_signal(signal.SIGKILL)
        replica.process.wait()

    def restart_postgres(self) -> None:
        subprocess.run(_as_postgres([_bin("pg_ctl"), "-D", str(self.data_dir), "-m", "fast",
                                     "-o", self.pg_options, "-w", "-l",
                                     str(self.data_dir.parent / "log"), "restart"]),
                       check=True, capture_output=True)


def _start_replica(database_url: str, home: Path, env_extra: dict[str, str]) -> Replica:
    port = free_port()
    env = {**os.environ, "GPUCLOUD_DATABASE_URL": database_url, "GPUCLOUD_HOME": str(home),
           "GPUCLOUD_ADMIN_KEY": ADMIN_KEY, **env_extra}
    process = subprocess.Popen(
        [sys.executable, "-m", "gpucloud.cli.main", "server", "--port", str(port),
         "--ssh-port", str(free_port())], env=env, stdout=subprocess.DEVNULL,
        stderr=open(home / "server.log", "wb"))  # noqa: SIM115 - the child owns it
    return Replica(port, process)


@contextmanager
def replica_cluster(count: int, tmp: Path, env: dict[str, str],
                    each: list[dict[str, str]] | None = None) -> Iterator[Cluster]:
    """``count`` replicas, each with ``env`` and its own entry of ``each``, if given."""
    with postgres_server() as url:
        port = url.rsplit(":", 1)[1].split("/")[0]
        rows = psycopg.connect(url.replace("+psycopg", ""), autocommit=True).execute(
            "SHOW data_directory").fetchall()
        data_dir = Path(rows[0][0])
        options = (f"-c listen_addresses=127.0.0.1 -p {port} -k {data_dir.parent} "
                   "-c max_connections=200 -c fsync=off -c synchronous_commit=off")
        cluster = Cluster(url, data_dir, options)
        for index in range(count):
            home = tmp / f"replica-{index}"
            home.mkdir()
            extra = each[index] if each else {}
            cluster.replicas.append(_start_replica(url, home, env | extra))
        try:
            for replica in cluster.replicas:
                wait_for(partial(_healthy, replica), 180, f"replica on {replica.port}")
            yield cluster
        finally:
            for replica in cluster.live():
                replica.process.terminate()
            for replica in cluster.replicas:
                try:
                    replica.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    replica.process.kill()


def _healthy(replica: Replica) -> bool:
    if replica.process.poll() is not None:
        raise AssertionError(f"replica on {replica.port} exited")
    try:
        return httpx.get(replica.url + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
