"""The checkpoint request reaches a real container (``RuncDriver.signal``), and the CRIU
canary decides transparent checkpoints on this host — skipped, with the canary's own
failure message, where runc/CRIU cannot dump and restore here."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpucloud.core.errors import InvalidInput
from gpucloud.runtime.bundle import ContainerSpec, ImageConfig
from gpucloud.runtime.criu import Canary, probe
from gpucloud.runtime.driver import RuncDriver
from gpucloud.runtime.logs import tail
from tests.integration.runtime.runc_testing import wait_until

pytestmark = pytest.mark.root


def test_signal_is_the_checkpoint_request(driver: RuncDriver, busybox_rootfs: Path) -> None:
    script = ("n=0; trap 'n=$((n+1)); echo checkpoint $n' USR1; echo ready; "
              "while true; do sleep 0.05; done")
    driver.build(ContainerSpec("c1", "c1", command=("sh", "-c", script)), busybox_rootfs,
                 ImageConfig())
    driver.start("c1")
    wait_until(lambda: b"ready" in tail(driver.log_path("c1"), 1), what="ready")
    assert driver.signal("c1", "SIGUSR1")
    wait_until(lambda: b"checkpoint 1" in tail(driver.log_path("c1"), 2), what="first")
    assert driver.signal("c1", "usr1")
    wait_until(lambda: b"checkpoint 2" in tail(driver.log_path("c1"), 2), what="second")
    with pytest.raises(InvalidInput):
        driver.signal("c1", "SIGNOPE")
    driver.stop("c1", grace_seconds=0)
    assert driver.wait("c1", timeout=10) is not None
    assert not driver.signal("c1", "SIGUSR1")  # it has ended: nothing to signal


def test_transparent_checkpoint_dump_and_restore(tmp_path: Path) -> None:
    """Runs where CRIU works; elsewhere SKIPPED with the exact reason, never passed."""
    capabilities = probe(tmp_path)
    if not capabilities.criu:
        pytest.skip(f"transparent checkpoints do not work on this host: "
                    f"{capabilities.criu_reason}")
    assert capabilities.criu_version
    Canary(tmp_path, "/usr/bin/runc", Path("/bin/busybox")).run()  # raises if it fails
    assert not (tmp_path / "criu-canary").exists()
