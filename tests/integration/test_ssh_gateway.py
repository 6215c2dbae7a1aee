"""The SSH gateway's decisions with the real OpenSSH client: who gets in, and what a user
sees when the pod cannot be reached (one line, exit 1, never a hang). Reaching a pod
through a real agent is in tests/e2e/test_access_ssh.py."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import update

from gpucloud.core.settings import Settings
from gpucloud.db.models import PodModel
from gpucloud.db.session import Database
from tests.conftest import ADMIN_KEY
from tests.e2e.cluster import wait_for
from tests.fixtures.openssh import OpenSsh, keygen
from tests.fixtures.postgres import free_port
from tests.fixtures.server import live_server
from tests.integration.conftest import h100_gpus


@dataclasses.dataclass
class Gateway:
    url: str
    port: int
    home: Path
    admin: httpx.Client

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"})


@pytest.fixture
def gateway(settings: Settings) -> Iterator[Gateway]:
    port = free_port()
    with live_server(dataclasses.replace(settings, ssh_port=port),
                     run_controllers=False) as url:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as api:
            yield Gateway(url, port, settings.home, api)


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_permission_denied_without_a_key_of_the_pods_project(gateway: Gateway,
                                                            tmp_path: Path) -> None:
    pod = gateway.admin.post("/v1/pods", json={"name": "dev", "image": "busybox",
                                               "command": ["true"]}).json()
    stranger = OpenSsh.for_gateway(gateway.home, tmp_path, gateway.port, "stranger")
    other = OpenSsh.for_gateway(gateway.home, tmp_path, gateway.port, "other")
    team = gateway.admin.post("/v1/projects", json={"name": "team-b"}).json()["key"]["key"]
    with gateway.client(team) as team_b:
        team_b.post("/v1/ssh-keys", json={"public_key": other.public_key}).raise_for_status()
        team_b.post("/v1/pods", json={"name": "dev", "image": "busybox",
                                      "command": ["true"]}).raise_for_status()
    for client, user in ((stranger, pod["id"]), (other, pod["id"]),
                         (other, f"{pod['id']}-abc"), (stranger, "dev")):
        done = client.run(client.ssh(user, "true"))
        assert done.returncode == 255
        assert b"Permission denied" in done.stderr, done.stderr


def test_a_pod_that_is_not_running_gets_one_line_and_exit_1(gateway: Gateway,
                                                           tmp_path: Path) -> None:
    user = OpenSsh.for_gateway(gateway.home, tmp_path, gateway.port)
    gateway.admin.post("/v1/ssh-keys", json={"public_key": user.public_key}).raise_for_status()
    pod = gateway.admin.post("/v1/pods", json={"name": "dev", "image": "busybox",
                                               "command": ["true"]}).json()
    for login in (pod["id"], f"{pod['id']}-64410f3c", "dev"):
        done = user.run(user.ssh(login, "echo", "hi"))
        assert done.returncode == 1
        lines = done.stderr.decode().strip().splitlines()
        assert lines == ["pod dev is Pending; wait until it is Running "
                         "(`gpucloud pod get dev`)"], done.stderr
        assert done.stdout == b""
    _forward_is_refused(user, "dev")


def _forward_is_refused(user: OpenSsh, login: str) -> None:
    """``ssh -L`` logs in, but a connection through the forward is closed at once and ssh
    reports why."""
    local = free_port()
    process = subprocess.Popen(user.ssh(login, "-N", "-L", f"127.0.0.1:{local}:localhost:80",
                                        log_level="INFO"),
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    try:
        wait_for(lambda: _accepts(local), 20, "ssh -L to listen")
        with socket.create_connection(("127.0.0.1", local), timeout=10) as conn:
            assert conn.recv(1) == b""
    finally:
        process.terminate()
        try:
            _, err = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a loaded machine: what it printed still counts
            process.kill()
            _, err = process.communicate(timeout=10)
    assert b"open failed" in err and b"is Pending" in err, err


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_an_unreachable_agent_is_one_line_not_a_hang(gateway: Gateway, tmp_path: Path,
                                                     settings: Settings) -> None:
    user = OpenSsh.for_gateway(gateway.home, tmp_path, gateway.port)
    gateway.admin.post("/v1/ssh-keys", json={"public_key": user.public_key}).raise_for_status()
    token = gateway.admin.post("/v1/nodes/join-tokens").json()["token"]
    closed = _closed_port()
    reg = httpx.post(f"{gateway.url}/v1/agent/register", json={
        "join_token": token, "name": "gpu-1", "cpu_cores": 64, "memory_bytes": 1 << 39,
        "gpus": h100_gpus(), "access_endpoint": f"127.0.0.1:{closed}",
        "access_host_key": keygen(tmp_path / "agent-host-key")}).json()
    pod = gateway.admin.post("/v1/pods", json={"name": "dev", "image": "busybox",
                                               "command": ["sleep", "600"]}).json()
    _bind_and_run(settings, pod["id"], reg["node_id"])
    done = user.run(user.ssh("dev", "true"), timeout=30)
    assert done.returncode == 1
    [line] = done.stderr.decode().strip().splitlines()
    assert line.startswith(f"cannot reach the agent of pod dev at 127.0.0.1:{closed}")


def _bind_and_run(settings: Settings, pod_id: str, node_id: str) -> None:
    """Put the pod Running on the node straight in the database (the scheduler and the
    agent are not what this test is about)."""
    db = Database(settings.database_url)
    try:
        with db.transaction() as session:
            session.execute(update(PodModel).where(PodModel.id == pod_id)
                            .values(node_id=node_id, phase="Running"))
    finally:
        db.dispose()
