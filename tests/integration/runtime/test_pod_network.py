"""Pod networks with real runc containers: a namespace, veth and address per container on
the agent's bridge; two agents' bridges routed to each other; nothing left behind."""

from __future__ import annotations

import ipaddress
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpucloud.core.errors import InvalidInput
from gpucloud.runtime.bundle import ContainerSpec, ImageConfig
from gpucloud.runtime.driver import RuncDriver
from gpucloud.runtime.network import NETNS_DIR, BridgeNetwork, PodAddress
from tests.fixtures.http import http_get
from tests.integration.runtime.runc_testing import RUNC, cleanup, wait_until

pytestmark = pytest.mark.root

#: The test containers share one root filesystem: each serves from a directory of its own.
SERVE = ("mkdir -p /srv/{name} && echo {name} > /srv/{name}/index.html && "
         "exec httpd -f -p 8000 -h /srv/{name}")


class Node:
    """One simulated agent's runtime: a driver and the bridge network of its state dir."""

    def __init__(self, state_dir: Path, rootfs: Path) -> None:
        self.driver = RuncDriver(state_dir, runc=str(RUNC))
        self.network = BridgeNetwork(state_dir)
        self.rootfs = rootfs

    def run(self, cid: str, script: str) -> PodAddress:
        address = self.network.attach(cid)
        spec = ContainerSpec(cid, cid, command=("sh", "-c", script), netns=address.netns,
                             ip=address.ip)
        self.driver.build(spec, self.rootfs, ImageConfig())
        self.driver.start(cid)
        return address

    def remove(self, cid: str) -> None:
        self.driver.stop(cid, grace_seconds=0)
        self.driver.wait(cid, timeout=10)
        self.driver.remove(cid)
        self.network.detach(cid)

    def close(self) -> None:
        cleanup(self.driver)
        self.network.destroy()


@pytest.fixture
def nodes(tmp_path: Path, busybox_rootfs: Path) -> Iterator[list[Node]]:
    made = [Node(tmp_path / f"agent-{n}", busybox_rootfs) for n in range(2)]
    yield made
    for node in made:
        node.close()


def leftovers(network: BridgeNetwork) -> list[str]:
    """What of ``network`` is still on the host: links, namespaces, iptables rules."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                           check=True).stdout
    found = [line.split(":")[1].strip() for line in links.splitlines()
             if network.bridge in line or "gcv" in line and f"master {network.bridge}" in line]
    if NETNS_DIR.is_dir():
        found += [p.name for p in NETNS_DIR.iterdir() if p.name.startswith(network.netns_prefix)]
    for table in ("nat", "filter"):
        rules = subprocess.run(["iptables", "-t", table, "-S"], capture_output=True, text=True,
                               check=True).stdout
        found += [rule for rule in rules.splitlines()
                  if network.bridge in rule or str(network.subnet) in rule]
    return found


def test_two_pods_listen_on_one_port_each_at_its_own_address(nodes: list[Node]) -> None:
    node = nodes[0]
    node.network.start(keep=())
    first = node.run("c1", SERVE.format(name="first"))
    second = node.run("c2", SERVE.format(name="second"))
    assert first.ip != second.ip
    subnet = node.network.subnet
    assert subnet is not None and subnet.prefixlen == 24
    assert {ipaddress.IPv4Address(first.ip), ipaddress.IPv4Address(second.ip)} <= set(subnet)
    wait_until(lambda: http_get(first.ip, 8000) == "first", what="the first pod's server")
    wait_until(lambda: http_get(second.ip, 8000) == "second", what="the second pod's server")
    hosts = (node.driver.paths("c1").etc_dir / "hosts").read_text()
    assert f"{first.ip}\tc1" in hosts


def test_a_pod_of_one_agent_reaches_a_pod_of_another(nodes: list[Node]) -> None:
    a, b = nodes
    a.network.start(keep=())
    b.network.start(keep=())
    assert a.network.subnet is not None and b.network.subnet is not None
    assert not a.network.subnet.overlaps(b.network.subnet)
    assert a.network.bridge != b.network.bridge and len(a.network.bridge) <= 15
    server = b.run("srv", SERVE.format(name="served-by-b"))
    wait_until(lambda: http_get(server.ip, 8000) == "served-by-b", what="the server on agent B")
    a.run("cli", f"wget -q -O - http://{server.ip}:8000/ && echo from $(hostname -i)")
    assert a.driver.wait("cli", timeout=15) is not None
    log = a.driver.log_path("cli").read_text()
    assert "served-by-b" in log, log


def test_teardown_is_idempotent_and_leaves_nothing_behind(nodes: list[Node]) -> None:
    node = nodes[0]
    node.network.start(keep=())
    address = node.run("c1", SERVE.format(name="x"))
    veth = node.network.veth_name("c1")
    assert Path(address.netns).exists() and Path("/sys/class/net", veth).exists()
    node.remove("c1")
    node.network.detach("c1")  # a second teardown does nothing
    assert not Path(address.netns).exists() and not Path("/sys/class/net", veth).exists()
    assert node.network.address_of("c1") is None
    before = leftovers(node.network)  # the bridge and its rules: the agent's, kept
    assert node.network.bridge in before
    assert any("MASQUERADE" in rule for rule in before), before
    assert sum(f"FORWARD -i {node.network.bridge}" in r or f"FORWARD -o {node.network.bridge}"
               in r for r in before) == 2, before
    node.network.destroy()
    node.network.destroy()
    assert not leftovers(node.network), leftovers(node.network)


def test_a_restarted_agent_keeps_running_pods_and_reclaims_leaks(nodes: list[Node]) -> None:
    node = nodes[0]
    node.network.start(keep=())
    kept = node.run("kept", SERVE.format(name="kept"))
    leaked = node.network.attach("leaked")  # its container is gone: a crash in between
    restarted = BridgeNetwork(node.driver.state_dir)
    restarted.start(keep={"kept"})
    assert restarted.subnet == node.network.subnet
    assert restarted.address_of("kept") == kept.ip and restarted.address_of("leaked") is None
    assert not Path(leaked.netns).exists()
    assert restarted.attach("kept") == kept  # adoption: same namespace, same address
    wait_until(lambda: http_get(kept.ip, 8000) == "kept", what="the adopted pod's server")
    again = restarted.attach("new")
    assert again.ip == leaked.ip  # the reclaimed address is handed out again


def test_agents_starting_at_once_pick_different_subnets(tmp_path: Path) -> None:
    networks = [BridgeNetwork(tmp_path / f"agent-{n}") for n in range(4)]
    errors: list[BaseException] = []

    def start(network: BridgeNetwork) -> None:
        try:
            network.start(keep=())
        except BaseException as error:  # noqa: BLE001 - reported by the test below
            errors.append(error)

    threads = [threading.Thread(target=start, args=(n,)) for n in networks]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not errors, errors
        subnets = [n.subnet for n in networks]
        assert all(s is not None for s in subnets)
        for i, first in enumerate(subnets):
            for second in subnets[i + 1:]:
                assert first is not None and second is not None
                assert not first.overlaps(second)
    finally:
        for network in networks:
            network.destroy()


def test_a_pod_cidr_that_overlaps_the_host_is_refused(tmp_path: Path) -> None:
    network = BridgeNetwork(tmp_path / "agent", "127.0.0.0/24")
    with pytest.raises(InvalidInput) as caught:
        network.start(keep=())
    assert caught.value.field == "pod_cidr"
    network.destroy()
