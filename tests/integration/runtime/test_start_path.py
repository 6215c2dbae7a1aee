"""The cached start path's short cuts, with real namespaces and runc: the pod's namespace
made on a thread while its bundle is written (``NodeNetwork.prepare``/``ready``), and a
container in such a namespace created and started by one ``runc run --detach``."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpucloud.agent.podnetwork import NodeNetwork, node_network
from gpucloud.runtime.bundle import ContainerSpec, ImageConfig
from gpucloud.runtime.driver import ContainerState, RuncDriver
from gpucloud.runtime.layout import read_json
from gpucloud.runtime.supervisor import SPARE_IDLE_SECONDS
from tests.integration.runtime.runc_testing import RUNC, cleanup, scheduled_assignment, wait_until

pytestmark = pytest.mark.root


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
    network.prepare("c1-1", scheduled_assignment("c1"))
    net = network.attach("c1-1", scheduled_assignment("c1"))  # the address, while it is made
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
    network.prepare("c2-1", scheduled_assignment("c2"))
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
        net = network.attach("c3-1", scheduled_assignment("c3"))
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


def _spares(driver: RuncDriver) -> set[int]:
    """The zygote's spare supervisors: live processes with its command line, but not it,
    and not yet in a container's directory."""
    assert driver.zygote is not None
    if driver.zygote._process is None:
        return set()  # not started yet (``prestart`` starts it on a thread)
    zygote = driver.zygote._process.pid
    cmdline = Path(f"/proc/{zygote}/cmdline").read_bytes()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == zygote:
            continue
        try:
            same = (entry / "cmdline").read_bytes() == cmdline
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue  # gone meanwhile
        if same and state != "Z" and cwd == "/":
            found.add(int(entry.name))
    return found


def test_an_idle_zygote_hands_the_next_start_to_a_supervisor_made_ahead(
        driver: RuncDriver, busybox_rootfs: Path) -> None:
    """The start is served by the spare the zygote made while idle (it supervises the
    container); a spare that died is replaced by a fork for that start; the spare ends
    with the zygote."""
    driver.prestart()
    wait_until(lambda: len(_spares(driver)) == 1, what="a spare supervisor")
    (spare,) = _spares(driver)
    for cid in ("c4-1", "c5-1"):
        driver.build(ContainerSpec(cid, "c4", command=("echo", "hi")), busybox_rootfs,
                     ImageConfig())
    driver.start("c4-1")
    assert read_json(driver.paths("c4-1").supervisor_pid) == spare
    info = driver.wait("c4-1", timeout=20)
    assert info is not None and info.exit_code == 0
    assert driver.log_path("c4-1").read_text() == "hi\n"

    wait_until(lambda: bool(_spares(driver) - {spare}), what="the next spare")
    (dead,) = _spares(driver) - {spare}
    os.kill(dead, signal.SIGKILL)
    wait_until(lambda: dead not in _spares(driver), what="the spare to die")
    driver.start("c5-1")  # handed to no one: forked for, as without a spare
    assert read_json(driver.paths("c5-1").supervisor_pid) not in (spare, dead)
    info = driver.wait("c5-1", timeout=20)
    assert info is not None and info.exit_code == 0

    wait_until(lambda: bool(_spares(driver)), what="a spare after the fork")
    assert driver.zygote is not None
    driver.zygote.close()
    wait_until(lambda: not _spares(driver), what="the spare to end with the zygote")


def test_the_zygote_makes_no_spare_while_a_start_is_under_way(
        tmp_path: Path, busybox_rootfs: Path) -> None:
    """While a start's ``runc`` runs (held here by a shim until a file appears) the zygote
    makes no spare, however long it is idle; once the start's status line is in, the next
    spare comes. (Until s43 it came ``SPARE_IDLE_SECONDS`` after the hand-over: in the
    middle of that start's ``runc``.)"""
    release = tmp_path / "release"
    shim = tmp_path / "runc-shim"
    shim.write_text(f"#!/bin/sh\nwhile [ ! -e {release} ]; do sleep 0.01; done\n"
                    f'exec {RUNC} "$@"\n')
    shim.chmod(0o755)
    driver = RuncDriver(tmp_path / "state", runc=str(shim))
    starting = threading.Thread(target=driver.start, args=("c6-1",), daemon=True)
    try:
        driver.prestart()
        wait_until(lambda: len(_spares(driver)) == 1, what="a spare supervisor")
        driver.build(ContainerSpec("c6-1", "c6", command=("echo", "hi")), busybox_rootfs,
                     ImageConfig())
        starting.start()
        wait_until(driver.paths("c6-1").supervisor_pid.exists, what="the spare to take it")
        # Another process's idleness: no clock of ours to advance. Ten idle periods, in
        # which the zygote made its spare before.
        time.sleep(10 * SPARE_IDLE_SECONDS)
        assert not _spares(driver)
        release.touch()
        starting.join(20)
        assert driver.status("c6-1").state is not ContainerState.CREATING
        wait_until(lambda: len(_spares(driver)) == 1, what="the next spare")
    finally:
        release.touch()
        if starting.is_alive():
            starting.join(20)
        cleanup(driver)
        assert driver.zygote is not None
        driver.zygote.close()
