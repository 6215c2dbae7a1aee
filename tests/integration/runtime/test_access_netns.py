"""`ssh -L` (and the proxy's direct-tcpip streams) to a server that listens only on the
pod's own 127.0.0.1, with a real runc pod in a network namespace of its own on a bridge,
the agent's access server, and the real OpenSSH client."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncssh
import pytest

from gpucloud.agent.access import AccessServer, running_container
from gpucloud.runtime.bundle import ContainerSpec, ImageConfig
from gpucloud.runtime.driver import RuncDriver
from gpucloud.runtime.network import BridgeNetwork, PodAddress
from tests.integration.runtime.runc_testing import wait_until
from tests.integration.runtime.test_access_server import free_port, keygen

pytestmark = pytest.mark.root

POD_ID = "fedcba9876543210fedcba9876543210"
CID = f"{POD_ID}-1"
LOOPBACK_ONLY = ("mkdir -p /srv/lo && echo only-on-loopback > /srv/lo/index.html && "
                 "mkdir -p /srv/all && echo on-every-address > /srv/all/index.html && "
                 "httpd -p 127.0.0.1:8000 -h /srv/lo && httpd -p 8001 -h /srv/all && "
                 "while true; do sleep 1; done")


def http_get(port: int, host: str = "127.0.0.1", timeout: float = 5.0) -> str | None:
    """The body of ``GET /`` at host:port, or None when nothing answers."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"GET / HTTP/1.0\r\nHost: pod\r\n\r\n")
            chunks = []
            while data := sock.recv(65536):
                chunks.append(data)
    except OSError:
        return None
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return body.decode().strip() if head.startswith(b"HTTP/1.") else None


@dataclass
class NetPod:
    server: AccessServer
    key: Path
    address: PodAddress

    @property
    def port(self) -> int:
        assert self.server.bound_port is not None
        return self.server.bound_port

    def forward(self, destination: str, remote_port: int) -> tuple[subprocess.Popen[bytes], int]:
        local = free_port()
        process = subprocess.Popen(
            ["ssh", "-F", "/dev/null", "-i", str(self.key), "-o", "IdentitiesOnly=yes",
             "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
             "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
             "-p", str(self.port), "-N", "-o", "ExitOnForwardFailure=yes",
             "-L", f"{local}:{destination}:{remote_port}", f"{POD_ID}@127.0.0.1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        def listening() -> bool:
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", local)) == 0

        wait_until(listening, timeout=15, what="ssh -L listening")
        return process, local


@pytest.fixture
def netpod(driver: RuncDriver, busybox_rootfs: Path, tmp_path: Path) -> Iterator[NetPod]:
    network = BridgeNetwork(tmp_path / "net-state")
    network.start(keep=())
    try:
        address = network.attach(CID)
        spec = ContainerSpec(CID, "pod", command=("sh", "-c", LOOPBACK_ONLY),
                             netns=address.netns, ip=address.ip)
        driver.build(spec, busybox_rootfs, ImageConfig())
        (driver.paths(CID).root / "network.json").write_text(json.dumps(
            {"ip": address.ip, "host_network": False, "netns": address.netns}))
        driver.start(CID)
        wait_until(lambda: http_get(8001, address.ip) == "on-every-address", timeout=15,
                   what="the pod's servers")
        server = AccessServer(driver, lambda pod_id: running_container(driver, [CID], pod_id),
                              host_key_path=tmp_path / "access_host_key", python=sys.executable)
        key = keygen(tmp_path / "gateway_key")
        server.start()
        server.set_gateway_keys([(tmp_path / "gateway_key.pub").read_text()])
        try:
            yield NetPod(server, key, address)
        finally:
            server.stop()
            driver.stop(CID, grace_seconds=0)
            driver.wait(CID, timeout=10)
            driver.remove(CID)
    finally:
        network.detach(CID)
        network.destroy()


def test_ssh_l_to_localhost_reaches_a_server_bound_to_the_pods_loopback(netpod: NetPod) -> None:
    assert http_get(8000, netpod.address.ip, timeout=2) is None  # not from the host
    for destination in ("localhost", "127.0.0.1"):
        process, local = netpod.forward(destination, 8000)
        try:
            assert http_get(local) == "only-on-loopback"
        finally:
            process.terminate()
            process.wait(10)


def test_the_pods_own_ip_and_all_address_servers_keep_working(netpod: NetPod) -> None:
    process, local = netpod.forward(netpod.address.ip, 8001)
    try:
        assert http_get(local) == "on-every-address"
    finally:
        process.terminate()
        process.wait(10)
    process, local = netpod.forward("localhost", 8001)  # 0.0.0.0 includes the loopback
    try:
        assert http_get(local) == "on-every-address"
    finally:
        process.terminate()
        process.wait(10)


def test_direct_tcpip_streams_like_the_proxys(netpod: NetPod) -> None:
    """The proxy opens ``localhost:PORT`` channels over asyncssh, as here; a closed port is
    a clean channel-open failure, and the agent's loop stays in the host's namespace."""
    async def run() -> tuple[bytes, str]:
        async with asyncssh.connect(
                "127.0.0.1", netpod.port, username=POD_ID, client_keys=[str(netpod.key)],
                known_hosts=None, config=None) as conn:
            reader, writer = await conn.open_connection("localhost", 8000)
            writer.write(b"GET / HTTP/1.0\r\nHost: pod\r\n\r\n")
            body = await reader.read()
            with pytest.raises(asyncssh.ChannelOpenError) as refused:
                await conn.open_connection("127.0.0.1", 8999)
            return body, refused.value.reason

    body, reason = asyncio.run(run())
    assert body.endswith(b"only-on-loopback\n")
    assert "refused" in reason.lower()
    # the access server still binds and serves in the host's namespace
    process, local = netpod.forward("localhost", 8000)
    try:
        assert http_get(local) == "only-on-loopback"
    finally:
        process.terminate()
        process.wait(10)
