"""The cached start path's short cuts, with real namespaces and runc: the pod's namespace
made on a thread while its bundle is written (``NodeNetwork.prepare``/``ready``), and a
container in such a namespace created and started by one ``runc run --detach``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpucloud.agent.podnetwork import NodeNetwork, node_network
from gpucloud.core.models import AssignmentOut
from gpucloud.core.phases import PodPhase
from gpucloud.runtime.bundle import ContainerSpec, ImageConfig
from gpucloud.runtime.driver import ContainerState, RuncDriver
from tests.integration.runtime.runc_testing import RUNC, cleanup, wait_until

pytestmark = pytest.mark.root


def _assignment(pod_id: str) -> AssignmentOut:
    return AssignmentOut(pod_id=pod_id, name=pod_id, project="p", attempt=1,
                         desired_state="running", phase=PodPhase.SCHEDULED, image="busybox",
                         command=[], env={}, cpu_milli=1000, memory_bytes=1 << 30,
                         gpu_uuids=[], ports=[])


@pytest.fixture
def network(tmp_path: Path) -> Iterator[NodeNetwork]:
    made = node_network(tmp_path / "agent", mode="bridge", pod_cidr=None, address=None,
                        port_range=None)
    yield made
    made.close()
    assert made.bridge is not None
    made.bridge.destroy()


def test_a_namespace_made_ahead_holds_the_address_the_bundle_names(
        network: NodeNetwork, driver: RuncDriver, busybox_rootfs: Path) -> None:
    network.prepare("c1-1", _assignment("c1"))
    net = network.attach("c1-1", _assignment("c1"))  # the address, while it is made
    assert net.netns is not None
    spec = ContainerSpec("c1-1", "c1", command=("sh", "-c", "ip -4 -o addr show eth0"),
                         netns=net.netns, ip=net.ip)
    driver.build(spec, busybox_rootfs, ImageConfig())
    network.ready("c1-1")
    driver.start("c1-1")
    info = driver.wait("c1-1", timeout=20)
    assert info is not None and info.exit_code == 0, driver.log_path("c1-1").read_text()
    assert f"inet {net.ip}/" in driver.log_path("c1-1").read_text()
    driver.remove("c1-1")
    network.detach("c1-1")
    assert not Path(net.netns).exists()


def test_a_namespace_removed_while_it_is_made_leaves_nothing(network: NodeNetwork) -> None:
    assert network.bridge is not None
    network.prepare("c2-1", _assignment("c2"))
    network.detach("c2-1")  # waits for the making, then removes it
    assert not network.bridge.netns_path("c2-1").exists()
    assert network.bridge.address_of("c2-1") is None
    network.ready("c2-1")  # nothing left to wait for


def test_a_container_in_an_agent_namespace_runs_with_one_runc_run(
        network: NodeNetwork, tmp_path: Path, busybox_rootfs: Path) -> None:
    """Created and started by ``runc run --detach`` (no ``runc start``; runc itself, behind
    a shim that notes each command): its output, its exit on SIGTERM and the stop record
    are what create + start gave."""
    calls = tmp_path / "runc-calls"
    shim = tmp_path / "runc-shim"
    shim.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {RUNC} "$@"\n')
    shim.chmod(0o755)
    driver = RuncDriver(tmp_path / "state", runc=str(shim))
    try:
        net = network.attach("c3-1", _assignment("c3"))
        spec = ContainerSpec("c3-1", "c3", command=(
            "sh", "-c", "trap 'exit 3' TERM; echo up; while true; do sleep 0.05; done"),
            netns=net.netns, ip=net.ip)
        driver.build(spec, busybox_rootfs, ImageConfig())
        assert driver.start("c3-1").state is ContainerState.RUNNING
        wait_until(lambda: driver.log_path("c3-1").read_text() == "up\n", what="its output")
        driver.stop("c3-1", grace_seconds=10)
        info = driver.wait("c3-1", timeout=20)
        assert info is not None and info.exit_code == 3 and info.stop_requested
        assert not info.killed_after_grace
        verbs = [line.split()[6] for line in calls.read_text().splitlines()
                 if line.startswith("--root") and len(line.split()) > 6]
        assert verbs[0] == "run" and "start" not in verbs and "create" not in verbs, verbs
    finally:
        cleanup(driver)
        network.detach("c3-1")
