"""`ssh -L` (and the proxy's direct-tcpip streams) to a server that listens only on the
pod's own 127.0.0.1, with a real runc pod in a network namespace of its own on a bridge,
the agent's access server, and the real OpenSSH client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncssh
import pytest

from gpucloud.runtime.bundle import ContainerSpec, ImageConfig
from gpucloud.runtime.driver import RuncDriver
from gpucloud.runtime.network import BridgeNetwork, PodAddress
from tests.fixtures.http import http_get
from tests.integration.runtime.access_testing import AccessClient, access_server
from tests.integration.runtime.runc_testing import wait_until

pytestmark = pytest.mark.root

POD_ID = "fedcba9876543210fedcba9876543210"
CID = f"{POD_ID}-1"
LOOPBACK_ONLY = ("mkdir -p /srv/lo && echo only-on-loopback > /srv/lo/index.html && "
                 "mkdir -p /srv/all && echo on-every-address > /srv/all/index.html && "
                 "httpd -p 127.0.0.1:8000 -h /srv/lo && httpd -p 8001 -h /srv/all && "
                 "while true; do sleep 1; done")


@dataclass
class NetPod(AccessClient):
    address: PodAddress


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
        wait_until(lambda: http_get(address.ip, 8001) == "on-every-address", timeout=15,
                   what="the pod's servers")
        try:
            with access_server(driver, CID, tmp_path) as (server, key):
                yield NetPod(server, key, POD_ID, address)
        finally:
            driver.stop(CID, grace_seconds=0)
            driver.wait(CID, timeout=10)
            driver.remove(CID)
    finally:
        network.detach(CID)
        network.destroy()


def test_ssh_l_to_localhost_reaches_a_server_bound_to_the_pods_loopback(netpod: NetPod) -> None:
    assert http_get(netpod.address.ip, 8000, timeout=2) is None  # not from the host
    for destination in ("localhost", "127.0.0.1"):
        with netpod.forward(destination, 8000) as local:
            assert http_get("127.0.0.1", local) == "only-on-loopback"


def test_the_pods_own_ip_and_all_address_servers_keep_working(netpod: NetPod) -> None:
    with netpod.forward(netpod.address.ip, 8001) as local:
        assert http_get("127.0.0.1", local) == "on-every-address"
    with netpod.forward("localhost", 8001) as local:  # 0.0.0.0 includes the loopback
        assert http_get("127.0.0.1", local) == "on-every-address"


def test_direct_tcpip_streams_like_the_proxys(netpod: NetPod) -> None:
    """The proxy opens ``localhost:PORT`` channels over asyncssh, as here; a closed port is
    a clean channel-open failure, and the agent's loop stays in the host's namespace."""
    async def run() -> tuple[bytes, str]:
        async with netpod.connect() as conn:
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
    with netpod.forward("localhost", 8000) as local:
        assert http_get("127.0.0.1", local) == "only-on-loopback"
