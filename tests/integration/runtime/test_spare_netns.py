"""Spare network namespaces (runtime/network ``make_spare``/``claim``, agent/podnetwork):
made ahead with their host end down and on no bridge, claimed by a pod's start as the
container's own (its names, its address, on the bridge), reclaimed after a crash, removed
when the agent stops, and one that cannot be claimed removed while the start makes its
namespace as without spares, at the address it took."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpucloud.agent.podnetwork import NodeNetwork
from gpucloud.agent.ports import PortForwarder, listen_hosts
from gpucloud.runtime.bundle import ContainerSpec, ImageConfig
from gpucloud.runtime.driver import RuncDriver
from gpucloud.runtime.network import NETNS_DIR, SPARE_PREFIX, BridgeNetwork
from tests.integration.runtime.runc_testing import scheduled_assignment, wait_until

pytestmark = pytest.mark.root


def _network(state_dir: Path, spares: int) -> NodeNetwork:
    forwarder = PortForwarder(listen_hosts(None), (42000, 42999), seed=str(state_dir))
    network = NodeNetwork(state_dir, public_ip="127.0.0.1", forwarder=forwarder,
                          spares=spares, spare_idle=0.0)
    network.start()
    return network


@pytest.fixture
def network(tmp_path: Path) -> Iterator[NodeNetwork]:
    made = _network(tmp_path / "agent", spares=2)
    yield made
    made.close()
    assert made.bridge is not None
    made.bridge.destroy()


def _link(name: str) -> dict[str, object]:
    shown = subprocess.run(["ip", "-j", "link", "show", "dev", name], capture_output=True,
                           text=True, check=True).stdout
    link: dict[str, object] = json.loads(shown)[0]
    return link


def _spare_names(bridge: BridgeNetwork) -> set[str]:
    return {p.name.removeprefix(bridge.netns_prefix) for p in NETNS_DIR.iterdir()
            if p.name.startswith(bridge.netns_prefix + SPARE_PREFIX)}


def test_a_spare_is_unreachable_until_a_start_claims_it_as_its_own(
        network: NodeNetwork, driver: RuncDriver, busybox_rootfs: Path) -> None:
    bridge = network.bridge
    assert bridge is not None
    wait_until(lambda: bridge.spare_count == 2, what="two spare namespaces")
    spares = _spare_names(bridge)
    assert len(spares) == 2
    for spare in spares:
        host_end = _link(bridge.veth_name(spare))
        assert "UP" not in host_end["flags"] and "master" not in host_end  # type: ignore[operator]
        assert bridge.address_of(spare) is not None

    network.prepare("c1-1", scheduled_assignment("c1"))
    net = network.attach("c1-1", scheduled_assignment("c1"))
    network.ready("c1-1")
    claimed = (spares - _spare_names(bridge))
    assert len(claimed) == 1 and bridge.address_of(claimed.pop()) is None
    assert net.netns == str(bridge.netns_path("c1-1")) and Path(net.netns).exists()
    assert bridge.address_of("c1-1") == net.ip
    host_end = _link(bridge.veth_name("c1-1"))
    assert host_end["master"] == bridge.bridge and "UP" in host_end["flags"]  # type: ignore[operator]

    spec = ContainerSpec("c1-1", "c1", netns=net.netns, ip=net.ip, command=(
        "sh", "-c", f"ip -4 -o addr show eth0 && ping -c 1 -W 5 {bridge.gateway}"))
    driver.build(spec, busybox_rootfs, ImageConfig())
    driver.start("c1-1")
    info = driver.wait("c1-1", timeout=20)
    output = driver.log_path("c1-1").read_text()
    assert info is not None and info.exit_code == 0, output
    assert f"inet {net.ip}/" in output and "1 packets received" in output

    # Its start is under way until the worker says it is over: no spare is made meanwhile
    # (the maker waits for ``started``, up to START_SECONDS, not for a quiet interval).
    assert bridge.spare_count == 1
    network.started("c1-1")
    wait_until(lambda: bridge.spare_count == 2, what="the pool made whole again")
    driver.remove("c1-1")
    network.detach("c1-1")
    assert not Path(net.netns).exists() and bridge.address_of("c1-1") is None


def test_spares_are_removed_on_close_and_reclaimed_after_a_crash(tmp_path: Path) -> None:
    state = tmp_path / "agent"
    crashed = _network(state, spares=2)
    bridge = crashed.bridge
    assert bridge is not None
    wait_until(lambda: bridge.spare_count == 2, what="two spare namespaces")
    crashed._closed.set()  # the agent died: nothing removed its spares
    crashed._spares_wanted.set()
    left = _spare_names(bridge)
    assert len(left) == 2

    restarted = _network(state, spares=0)  # its start reclaims them
    assert restarted.bridge is not None
    assert not _spare_names(restarted.bridge)
    assert all(restarted.bridge.address_of(spare) is None for spare in left)
    assert all(not Path("/sys/class/net", bridge.veth_name(s)).exists() for s in left)
    restarted.close()

    again = _network(state, spares=1)
    assert again.bridge is not None
    wait_until(lambda: again.bridge is not None and again.bridge.spare_count == 1,
               what="a spare")
    (spare,) = _spare_names(again.bridge)
    again.close()
    assert not _spare_names(again.bridge) and again.bridge.address_of(spare) is None
    again.bridge.destroy()


def test_a_spare_that_cannot_be_claimed_is_removed_and_the_start_makes_its_own(
        network: NodeNetwork) -> None:
    bridge = network.bridge
    assert bridge is not None
    wait_until(lambda: bridge.spare_count == 2, what="two spare namespaces")
    before = _spare_names(bridge)
    taken = bridge.veth_name("c2-1")  # a leftover holds the container's veth name
    subprocess.run(["ip", "link", "add", taken, "type", "veth", "peer", "name", "gcvleftpeer"],
                   check=True)
    try:
        address = bridge.claim("c2-1")  # made as without spares, the leftover removed
        assert address is not None and Path(address.netns).exists()
        (tried,) = before - _spare_names(bridge)
        assert bridge.address_of(tried) is None and not bridge.netns_path(tried).exists()
        assert bridge.address_of("c2-1") == address.ip
        assert not Path("/sys/class/net", bridge.veth_name(tried)).exists()
        assert _link(taken)["master"] == bridge.bridge
    finally:
        bridge.detach("c2-1")
        subprocess.run(["ip", "link", "del", taken], check=False, capture_output=True)


def test_a_container_in_a_claimed_namespace_is_adopted_after_a_restart(
        network: NodeNetwork, driver: RuncDriver, busybox_rootfs: Path) -> None:
    bridge = network.bridge
    assert bridge is not None
    wait_until(lambda: bridge.spare_count >= 1, what="a spare namespace")
    network.prepare("c3-1", scheduled_assignment("c3"))
    net = network.attach("c3-1", scheduled_assignment("c3"))
    assert net.netns is not None
    spec = ContainerSpec("c3-1", "c3", netns=net.netns, ip=net.ip,
                         command=("sh", "-c", "httpd -f -p 8000 -h /etc"))
    driver.build(spec, busybox_rootfs, ImageConfig())
    driver.start("c3-1")
    restarted = BridgeNetwork(bridge.state_dir)
    restarted.start(keep={"c3-1"})  # the spares go; the container's namespace stays
    assert not _spare_names(restarted)
    address = restarted.attach("c3-1")
    assert (address.ip, address.netns) == (net.ip, net.netns)
    driver.stop("c3-1", grace_seconds=0)
    driver.wait("c3-1", timeout=10)
    driver.remove("c3-1")
    network.detach("c3-1")
