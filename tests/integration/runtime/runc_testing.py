"""Helpers for real runc containers: a busybox root filesystem, a driver per test, polling.

Needs root, /usr/bin/runc and a static busybox (Debian: runc, busybox-static).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpucloud.core.models import AssignmentOut
from gpucloud.core.phases import PodPhase
from gpucloud.runtime.driver import ContainerState, RuncDriver

BUSYBOX = Path("/bin/busybox")
RUNC = Path("/usr/bin/runc")


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root for runc"
    if not RUNC.exists():
        return "needs /usr/bin/runc (Debian package runc)"
    if not BUSYBOX.exists():
        return "needs /bin/busybox (Debian package busybox-static)"
    return None


def make_busybox_rootfs(target: Path) -> Path:
    """A minimal root filesystem: static busybox with one symlink per applet, /etc files."""
    bin_dir = target / "bin"
    bin_dir.mkdir(parents=True)
    shutil.copy2(BUSYBOX, bin_dir / "busybox")
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    for applet in applets:
        if applet != "busybox":
            (bin_dir / applet).symlink_to("busybox")
    (target / "usr").mkdir()
    (target / "usr" / "bin").symlink_to("/bin")
    for directory in ("etc", "tmp", "proc", "sys", "dev", "root", "home/app"):
        (target / directory).mkdir(parents=True, exist_ok=True)
    (target / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n"
    )
    (target / "etc" / "group").write_text("root:x:0:\napp:x:1000:\nvideo:x:44:app\n")
    return target


@pytest.fixture(scope="session")
def busybox_rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # `make test` installs runc and busybox and CI runs as root: a missing piece is a broken
    # setup, reported as a failure (like the registry fixture), never a silent skip.
    missing = _missing()
    if missing:
        pytest.fail(f"runtime tests: {missing}; run `make test` as root", pytrace=False)
    return make_busybox_rootfs(tmp_path_factory.mktemp("busybox") / "rootfs")


def cleanup(driver: RuncDriver) -> None:
    """Stop and remove every container of ``driver``, then its cgroup parents."""
    for status in driver.containers():
        if status.state in (ContainerState.RUNNING, ContainerState.CREATING):
            driver.stop(status.container_id, grace_seconds=0)
            driver.wait(status.container_id, timeout=10)
        driver.remove(status.container_id)
    driver.prune_cgroups()


@pytest.fixture
def driver(tmp_path: Path, busybox_rootfs: Path) -> Iterator[RuncDriver]:
    runc_driver = RuncDriver(tmp_path / "state", runc=str(RUNC))
    yield runc_driver
    cleanup(runc_driver)


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll ``condition`` until it holds; fail the test when ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def scheduled_assignment(pod_id: str) -> AssignmentOut:
    """A 1-CPU busybox pod with no GPUs as the agent receives it, ready to start."""
    return AssignmentOut(pod_id=pod_id, name=pod_id, project="p", attempt=1,
                         desired_state="running", phase=PodPhase.SCHEDULED, image="busybox",
                         command=[], env={}, cpu_milli=1000, memory_bytes=1 << 30,
                         gpu_uuids=[], ports=[])
