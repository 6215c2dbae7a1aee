"""What the fault scenarios share: a PostgreSQL that can be stopped, a server that can also
listen on a test network namespace's veth, agents that run offline from an imported image,
inside a namespace or under a time namespace, and the "nothing lost" checks.

Every wait polls a condition against a deadline (``tests.e2e.cluster.wait_for``).
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import uvicorn

from gpucloud.api.app import create_app
from gpucloud.client.sdk import GpucloudClient
from gpucloud.core.settings import Settings
from gpucloud.images import ImageManager
from gpucloud.runtime.driver import ContainerState, ContainerStatus
from tests.e2e.cluster import ADMIN_KEY, AgentProcess, Cloud, ServerThread, clean_node, wait_for
from tests.fixtures.postgres import _as_postgres, _bin, free_port

IMAGE = "gpucloud/faults"
#: A pod that keeps running and says so: one numbered line every 50 ms.
COUNTER = ["sh", "-c", "i=0; while true; do i=$((i+1)); echo line $i; sleep 0.05; done"]
_databases = itertools.count(1)


class Postgres:
    """A throwaway PostgreSQL cluster on 127.0.0.1 that a test may stop and start again
    (same port, same data): ``tests.fixtures.postgres`` only starts one for a session.

    With ``primary``, a streaming standby of it instead of a new cluster: a copy by
    ``pg_basebackup -R -X stream`` (``-R`` writes ``standby.signal`` and the connection
    back to the primary), read-only until ``promote``."""

    def __init__(self, primary: Postgres | None = None) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="gpucloud-faults-pg-"))
        self.data = self.base / "data"
        self.port = free_port()
        if os.geteuid() == 0:
            os.chown(self.base, pwd.getpwnam("postgres").pw_uid, -1)
        if primary is None:
            # initdb's pg_hba.conf already trusts replication connections from 127.0.0.1
            # (-A trust), and wal_level=replica with 10 WAL senders are the defaults.
            command = [_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                       "--no-sync"]
        else:
            command = [_bin("pg_basebackup"), "-D", str(self.data), "-h", "127.0.0.1",
                       "-p", str(primary.port), "-U", "postgres", "-R", "-X", "stream",
                       "--checkpoint=fast", "--no-sync"]
        subprocess.run(_as_postgres(command), check=True, capture_output=True)

    def start(self) -> None:
        # synchronous_commit stays on: with it off a commit is acknowledged before its WAL
        # is written, and an immediate stop loses it (the restart scenario saw exactly
        # that). fsync=off only matters when the machine itself crashes.
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.base} "
                   "-c max_connections=200 -c fsync=off -c wal_level=replica "
                   "-c max_wal_senders=10")
        subprocess.run(_as_postgres([_bin("pg_ctl"), "-D", str(self.data), "-o", options, "-w",
                                     "-l", str(self.base / "log"), "start"]),
                       check=True, capture_output=True)

    def stop(self, mode: str = "immediate") -> None:
        """``immediate``: as a crash of the database server (every connection cut)."""
        subprocess.run(_as_postgres([_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w",
                                     "stop"]), check=True, capture_output=True)

    def promote(self) -> None:
        """A standby becomes a primary (read-write) and waits for it (``-w``)."""
        subprocess.run(_as_postgres([_bin("pg_ctl"), "-D", str(self.data), "-w", "promote"]),
                       check=True, capture_output=True)

    def sql(self, query: str, *params: object,
            dbname: str = "postgres") -> list[tuple[Any, ...]]:
        """Rows of one statement on this server alone (autocommit)."""
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}",
                             autocommit=True, connect_timeout=5) as connection:
            cursor = connection.execute(query, params)
            return cursor.fetchall() if cursor.description else []

    def new_database(self) -> str:
        """A new empty database's name."""
        name = f"faults_{os.getpid()}_{next(_databases)}"
        self.sql(f"CREATE DATABASE {name}")
        return name

    def fresh_database(self) -> str:
        """A new empty database; its SQLAlchemy URL (the server migrates it at start)."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{self.new_database()}"

    def close(self) -> None:
        subprocess.run(_as_postgres([_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate",
                                     "stop"]), capture_output=True)
        shutil.rmtree(self.base, ignore_errors=True)


class ReplicaPair:
    """A primary and its streaming standby, replicating synchronously: every commit the
    primary acknowledges is on the standby too (``synchronous_standby_names = '*'``,
    ``synchronous_commit`` on), so promoting the standby after the primary crashed loses
    no acknowledged write.

    The setting is made on the primary after the base backup (``ALTER SYSTEM``), so the
    standby's copy lacks it: once promoted, with no standby of its own, its commits do
    not wait for one."""

    def __init__(self) -> None:
        self.primary = Postgres()
        try:
            self.primary.start()
            self.standby = Postgres(primary=self.primary)
        except BaseException:
            self.primary.close()
            raise
        try:
            self.standby.start()
            self.primary.sql("ALTER SYSTEM SET synchronous_standby_names = '*'")
            self.primary.sql("SELECT pg_reload_conf()")
            wait_for(lambda: self.primary.sql("SELECT sync_state FROM pg_stat_replication")
                     == [("sync",)], 30, "the standby to replicate synchronously")
        except BaseException:
            self.close()
            raise

    def fresh_database(self) -> tuple[str, str]:
        """A new empty database (made on the primary, replicated): its name and a
        SQLAlchemy URL that names both servers, so that libpq connects to whichever one is
        read-write (the primary, then the promoted standby)."""
        name = self.primary.new_database()
        return name, (f"postgresql+psycopg://postgres@/{name}"
                      f"?host=127.0.0.1:{self.primary.port}&host=127.0.0.1:{self.standby.port}"
                      "&target_session_attrs=read-write")

    def close(self) -> None:
        self.standby.close()
        self.primary.close()


class FaultServer(ServerThread):
    """The server on a thread, listening on 127.0.0.1 and on ``extra_hosts`` (the host end
    of a test namespace's veth), on one port."""

    def __init__(self, settings: Settings, port: int, extra_hosts: list[str]) -> None:
        super().__init__(settings, port)
        self.extra_hosts = extra_hosts

    def start(self) -> None:
        sockets = []
        for host in ["127.0.0.1", *self.extra_hosts]:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, self.port))
            sockets.append(sock)
        config = uvicorn.Config(create_app(self.settings), log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, args=(sockets,), daemon=True)
        self._thread.start()
        wait_for(lambda: self._server is not None and self._server.started, 30,
                 "the server to start")
        httpx.get(f"{self.url}/healthz").raise_for_status()


@dataclass
class FaultCloud(Cloud):
    archive: Path = Path()

    def node_agent(self, name: str, *, prefix: list[str] | None = None,
                   server_url: str | None = None, address: str | None = None,
                   state_dir: Path | None = None, start: bool = True) -> AgentProcess:
        """An agent with the test image imported (no registry: a namespaced agent cannot
        reach the host's loopback), host networking, run under ``prefix`` (``ip netns exec
        …``, ``unshare --time …``) and talking to ``server_url``."""
        agent = self.agent(name, start=False, address=address,
                           extra=["--network", "host"])
        if state_dir is not None:
            agent.args[agent.args.index("--state-dir") + 1] = str(state_dir)
            agent.state_dir = state_dir
        with ImageManager(agent.state_dir) as images:
            images.import_archive(self.archive)
        if server_url is not None:
            agent.args[agent.args.index("--server") + 1] = server_url
        agent.args[:0] = prefix or []
        if start:
            agent.start()
            self.wait_started(agent)
        return agent


@contextmanager
def fault_cloud(workdir: Path, archive: Path, database_url: str, *, lease_ttl: float = 2.0,
                extra_hosts: list[str] | None = None, **overrides: Any) -> Iterator[FaultCloud]:
    """A server on ``database_url`` with a short lease and restart back-off; agents on
    demand; every container they leave is removed at the end."""
    settings = Settings(home=workdir / "home", database_url=database_url, admin_key=ADMIN_KEY,
                        lease_ttl_seconds=lease_ttl, restart_backoff_seconds=0.2,
                        restart_backoff_max_seconds=1.0, **overrides)
    server = FaultServer(settings, free_port(), extra_hosts or [])
    server.start()
    cloud = FaultCloud(server.url, GpucloudClient(server.url, ADMIN_KEY), workdir, server,
                       archive=archive)
    try:
        yield cloud
    finally:
        for agent in cloud.agents:
            if agent.process is not None and agent.process.poll() is None:
                agent.process.kill()
                agent.process.wait(10)
            clean_node(agent.state_dir)
        cloud.client.close()
        server.stop()


def running(agent: AgentProcess) -> list[ContainerStatus]:
    """The agent's containers that run (from its state directory and runc)."""
    return [c for c in agent.driver().containers() if c.state is ContainerState.RUNNING]


def pid_alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def log_text(agent: AgentProcess) -> str:
    return agent.log.read_text(errors="replace")
