"""Transparent checkpoints in the runtime: a container with its stdio on pipes (what a
dumpable container gets) logs and exits exactly as any other; where this node's CRIU
canary passes, one dumped with ``runc checkpoint`` is restored as a new container (as the
next attempt on another node would be) and counts on from where it was dumped.

The dump-and-restore test runs only where CRIU works: elsewhere it is skipped with the
canary's own reason (on Debian's CRIU 3.17 with a 6.x kernel: "vdso: Unexpected rt vDSO
area bounds"), never passed without running.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from gpucloud.runtime import criu
from gpucloud.runtime.bundle import ContainerSpec, ImageConfig
from gpucloud.runtime.driver import ContainerState, RuncDriver
from tests.integration.runtime.runc_testing import wait_until

pytestmark = pytest.mark.root

COUNTER = "i=0; while :; do i=$((i+1)); echo \"count $i\"; sleep 0.05; done"


def _counts(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"^count (\d+)$", text, re.M)]


def test_a_container_on_pipes_logs_and_exits_like_any_other(
        driver: RuncDriver, busybox_rootfs: Path) -> None:
    spec = ContainerSpec("piped-1", "pod", command=(
        "sh", "-c", "echo out; echo err >&2; read line || echo stdin-at-eof; exit 3"))
    driver.build(spec, busybox_rootfs, ImageConfig())
    driver.start("piped-1", pipe_log=True)
    info = driver.wait("piped-1", timeout=15)
    assert info is not None and (info.exit_code, info.checkpointed) == (3, False)
    text = driver.log_path("piped-1").read_text()
    assert text.splitlines() == ["out", "err", "stdin-at-eof"], text


def test_a_container_on_pipes_stops_on_request(driver: RuncDriver,
                                               busybox_rootfs: Path) -> None:
    spec = ContainerSpec("piped-2", "pod", command=("sh", "-c", COUNTER))
    driver.build(spec, busybox_rootfs, ImageConfig())
    driver.start("piped-2", pipe_log=True)
    wait_until(lambda: len(_counts(driver.log_path("piped-2").read_text())) >= 3, 10)
    driver.stop("piped-2", grace_seconds=0.2)
    info = driver.wait("piped-2", timeout=15)
    assert info is not None and info.stop_requested and not info.checkpointed


@pytest.fixture(scope="module")
def criu_capability(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Skip, with the canary's reason, where CRIU cannot dump and restore on this node."""
    capability = criu.probe(tmp_path_factory.mktemp("canary"))
    if not capability.criu:
        pytest.skip(f"transparent checkpoints not run: {capability.criu_reason}")


def test_a_dumped_container_is_restored_as_the_next_attempt_and_counts_on(
        criu_capability: None, driver: RuncDriver, busybox_rootfs: Path,
        tmp_path: Path) -> None:
    first, second = "pod-1", "pod-2"
    rootfs = tmp_path / "rootfs"
    shutil.copytree(busybox_rootfs, rootfs, symlinks=True)
    driver.build(ContainerSpec(first, "pod", command=("sh", "-c", COUNTER)), rootfs,
                 ImageConfig())
    driver.start(first, pipe_log=True)
    wait_until(lambda: len(_counts(driver.log_path(first).read_text())) >= 5, 10)
    image = tmp_path / "dump"
    driver.dump(first, image, leave_running=True)  # a periodic checkpoint: it runs on
    assert driver.status(first).state is ContainerState.RUNNING
    driver.dump(first, image, leave_running=False)  # the notice's: it ends
    info = driver.wait(first, timeout=15)
    assert info is not None and info.checkpointed
    dumped = _counts(driver.log_path(first).read_text())[-1]

    driver.build(ContainerSpec(second, "pod", command=("sh", "-c", COUNTER)), rootfs,
                 ImageConfig())
    driver.start(second, restore_from=image)
    wait_until(lambda: len(_counts(driver.log_path(second).read_text())) >= 5, 10)
    after = _counts(driver.log_path(second).read_text())
    assert after[0] == dumped + 1 and after == list(range(dumped + 1, dumped + 1 + len(after)))
    driver.stop(second, grace_seconds=0.2)
    assert driver.wait(second, timeout=15) is not None
