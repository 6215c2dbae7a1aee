"""A real cloud for end-to-end tests: the server on a thread, agents as processes.

Agents are ``python -m gpucloud.cli.agent`` processes (what ``gpucloud agent`` runs), so a
test can kill one with SIGKILL exactly as a crash would, and restart it on the same state
directory. Every wait polls a condition against a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn

from gpucloud.api.app import create_app
from gpucloud.client.sdk import GpucloudClient
from gpucloud.core.models import NodeOut, PodOut
from gpucloud.core.settings import Settings
from gpucloud.images import ImageManager
from gpucloud.images.lazy.client import LazyfsClient
from gpucloud.images.rootfs import unmount
from gpucloud.runtime.driver import ContainerState, RuncDriver
from gpucloud.runtime.network import BridgeNetwork
from tests.fixtures.postgres import free_port

ADMIN_KEY = "gpc_e2e-admin-key-0123456789"
#: The lease of a test cloud (the product default). The agent renews every third of it,
#: so a node stays Ready through an agent stall of up to about 6-10 s, as seen on a loaded
#: 2-core CI box (a 2 s lease lapsed there: pods went Lost under tests that never asked
#: for it). GPU health rides on those renewals: a report reaches the server within 3.3 s.
LEASE_TTL = 10.0
#: The lease of a cloud whose test makes a node go Lost by killing its agent
#: (``short_lease_cloud``): the loss is seen about this long after the kill, well inside
#: those tests' waits, while the surviving nodes (renewing every 1.7 s) still ride out
#: a stall of a few seconds.
SHORT_LEASE_TTL = 5.0
#: How long a process started by a test (an agent to its node ``Ready``, a server to its
#: first answer) may take. Starting one costs 2-4 s of CPU (imports, migrations, the join),
#: which on a machine at load 20 measured 13-80 s of wall clock; the wait ends as soon as
#: it is up, and at once if the process exits, so only a hang waits this long.
START_TIMEOUT = 120.0
#: The lease of a cloud whose nodes must stay Ready while an agent is down (killed and
#: started again): longer than such a restart at load 20 (measured over 15 s, the TTL
#: that was enough on an idle machine).
PATIENT_LEASE_TTL = 60.0
T = TypeVar("T")


def wait_for(check: Callable[[], T | None], timeout: float, what: str) -> T:
    """Poll ``check`` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.2)


@dataclass
class AgentProcess:
    """One ``gpucloud agent`` process; ``start`` again after ``kill``/``terminate``."""

    name: str
    state_dir: Path
    args: list[str]
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def log(self) -> Path:
        return self.state_dir.parent / f"{self.name}.log"

    def start(self) -> AgentProcess:
        self.starts += 1
        with self.log.open("ab") as out:
            out.write(f"--- start {self.starts}\n".encode())
            out.flush()
            self.process = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is cleaned up, the containers keep running."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)

    def terminate(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(15)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        """``running``, or fail the test at once with the end of its log."""
        if not self.running():
            assert self.process is not None
            pytest.fail(f"agent {self.name} exited ({self.process.returncode}):\n"
                        f"{self.log_tail()}")
        return True

    def driver(self) -> RuncDriver:
        return RuncDriver(self.state_dir)


class ServerThread:
    """The server on a thread of the test, on a fixed port so that it can be restarted
    (``tests.fixtures.server.live_server`` picks a new port each time)."""

    def __init__(self, settings: Settings, port: int) -> None:
        self.settings = settings
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        config = uvicorn.Config(create_app(self.settings), host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        wait_for(lambda: self._server is not None and self._server.started, 30,
                 "the server to start")
        httpx.get(f"{self.url}/healthz").raise_for_status()

    def stop(self) -> None:
        """Stop at once: in-flight long-polls are cut, as in a crash of the server."""
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._server.force_exit = True
        self._thread.join(timeout=15)


@dataclass
class Cloud:
    url: str
    client: GpucloudClient
    workdir: Path
    server: ServerThread
    agents: list[AgentProcess] = field(default_factory=list)

    def agent(self, name: str, *, registries: dict[str, dict[str, str]] | None = None,
              simulate: str = "dgx-h100", start: bool = True,
              address: str | None = None, extra: list[str] | None = None) -> AgentProcess:
        state_dir = self.workdir / name
        state_dir.mkdir(parents=True, exist_ok=True)
        if registries:
            (state_dir / "registries.json").write_text(json.dumps(registries))
        token = self.client.create_join_token().token
        args = [sys.executable, "-m", "gpucloud.cli.agent", "--server", self.url,
                "--join-token", token, "--name", name, "--state-dir", str(state_dir),
                "--simulate", simulate, "--stop-grace", "1", "--poll-wait", "2",
                *(["--address", address] if address else []), *(extra or [])]
        agent = AgentProcess(name, state_dir, args)
        self.agents.append(agent)
        if start:
            agent.start()
            self.wait_started(agent)
        return agent

    def wait_started(self, agent: AgentProcess, timeout: float = START_TIMEOUT) -> None:
        """Until ``agent``'s node is Ready (``START_TIMEOUT``: a process start on a loaded
        machine); fails at once, with its log, if the agent exits meanwhile."""
        def check() -> bool:
            return agent.alive() and any(n.name == agent.name and n.status == "Ready"
                                         for n in self.client.list_nodes())

        wait_for(check, timeout, f"agent {agent.name} to start and its node to be Ready")

    def restart_agent(self, agent: AgentProcess, timeout: float = START_TIMEOUT) -> None:
        """Kill -9 ``agent`` and start it again; back once the new process holds the lease
        (its fencing token moved on), not merely while the old grant is still Ready."""
        before = self._node(agent.name).fencing_token
        agent.kill()
        agent.start()
        self.wait_resumed(agent, before, timeout)

    def wait_resumed(self, agent: AgentProcess, before: int,
                     timeout: float = START_TIMEOUT) -> None:
        """Until the (re)started ``agent`` holds its node's lease: a fencing token newer
        than ``before``, Ready; fails at once, with its log, if the agent exits."""
        def resumed() -> bool:
            node = self._node(agent.name)
            return agent.alive() and node.fencing_token > before and node.status == "Ready"

        wait_for(resumed, timeout, f"the restarted agent {agent.name} to hold its lease")

    def _node(self, name: str) -> NodeOut:
        return next(n for n in self.client.list_nodes() if n.name == name)

    def wait_node(self, name: str, status: str, timeout: float = 20) -> None:
        def check() -> bool:
            return any(n.name == name and n.status == status for n in self.client.list_nodes())

        wait_for(check, timeout, f"node {name} to be {status}")

    def wait_pod(self, name: str, *phases: str, timeout: float = 30) -> PodOut:
        def check() -> PodOut | None:
            pod = self.client.get_pod(name)
            return pod if pod.phase in phases else None

        try:
            return wait_for(check, timeout, f"pod {name} to be {' or '.join(phases)}")
        except pytest.fail.Exception as timed_out:
            pod = self.client.get_pod(name)
            nodes = {n.name: n.status for n in self.client.list_nodes()}
            pytest.fail(f"{timed_out}; it is {pod.phase} ({pod.reason or 'no reason'}) on "
                        f"{pod.node or 'no node'}: {pod.message}; nodes {nodes}")

    def wait_log(self, name: str, needle: str, timeout: float = 20) -> str:
        def check() -> str | None:
            text = self.client.pod_logs(name).text
            return text if needle in text else None

        return wait_for(check, timeout, f"{needle!r} in the log of pod {name}")

    def create_pod(self, name: str, image: str, command: list[str], **fields: Any) -> PodOut:
        return self.client.create_pod({"name": name, "image": image, "command": command,
                                       **fields})


@contextmanager
def running_cloud(workdir: Path, lease_ttl: float = LEASE_TTL,
                  preemption_grace: float | None = None,
                  ssh_port: int | None = None,
                  database_url: str | None = None, port: int | None = None,
                  **overrides: Any) -> Iterator[Cloud]:
    """A server on SQLite (or ``database_url``; ``LEASE_TTL``, short restart back-off) on
    ``port`` (default: a free one); agents added on demand. ``overrides``: other
    ``Settings`` fields."""
    settings = Settings(home=workdir / "home",
                        database_url=database_url or f"sqlite:///{workdir / 'db.sqlite'}",
                        admin_key=ADMIN_KEY, lease_ttl_seconds=lease_ttl,
                        restart_backoff_seconds=0.2, restart_backoff_max_seconds=1.0,
                        preemption_grace_seconds=preemption_grace, ssh_port=ssh_port,
                        **overrides)
    with cloud_on(ServerThread(settings, port or free_port()), workdir) as cloud:
        yield cloud


@contextmanager
def cloud_on(server: ServerThread, workdir: Path) -> Iterator[Cloud]:
    """``server`` started, as a cloud with agents added on demand; at the end its agents
    are stopped and their nodes cleaned, then the server stopped."""
    server.start()
    cloud = Cloud(server.url, GpucloudClient(server.url, ADMIN_KEY), workdir, server)
    try:
        yield cloud
    finally:
        for agent in cloud.agents:
            if agent.running():
                agent.terminate()
            clean_node(agent.state_dir)
        cloud.client.close()
        server.stop()


def clean_node(state_dir: Path) -> None:
    """Kill and remove every container an agent left, unmount their root filesystems."""
    if not (state_dir / "containers").is_dir():
        return
    driver = RuncDriver(state_dir)
    images = ImageManager(state_dir)
    for status in driver.containers():
        if status.state in (ContainerState.RUNNING, ContainerState.CREATING):
            driver.stop(status.container_id, grace_seconds=0)
            driver.wait(status.container_id, timeout=10)
        images.release_rootfs(driver.paths(status.container_id).root)
        driver.remove(status.container_id)
    images.close()
    LazyfsClient(state_dir).shutdown()  # it outlives its agent by design; a test's must not
    BridgeNetwork(state_dir).destroy()  # namespaces, veths, the bridge, its iptables rules
    for mount in _mounts_under(state_dir):
        unmount(Path(mount))
    for parent in Path("/sys/fs/cgroup").glob(f"*/gpucloud/{driver.scope}"):
        for directory in sorted(parent.glob("**/"), key=lambda p: len(p.parts), reverse=True):
            try:
                directory.rmdir()
            except OSError:
                pass  # still in use, or already gone with its parent


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root.resolve())
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    return sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True)


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "end-to-end tests run containers and need root"
    for tool, package in (("/usr/bin/runc", "runc"), ("/bin/busybox", "busybox-static"),
                          ("/usr/bin/docker-registry", "docker-registry")):
        if not Path(tool).exists():
            return f"needs {tool} (Debian package {package})"
    return None
