"""Container escapes closed, checked from inside real runc containers built by the bundle
builder: Docker's capability set, its default seccomp profile, noNewPrivileges, masked and
read-only /proc paths.

A static C probe (syscall_probe.c, compiled here) tries the syscalls an escape needs; a
control run of the same probe with the seccomp section removed shows that it is the
profile, not the kernel or the capabilities, that refuses them.
"""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from gpucloud.runtime import oci, seccomp
from gpucloud.runtime.bundle import ContainerSpec, ImageConfig
from gpucloud.runtime.driver import RuncDriver
from gpucloud.runtime.layout import read_json
from tests.integration.runtime.runc_testing import make_busybox_rootfs

pytestmark = pytest.mark.root

PROBE_SOURCE = Path(__file__).with_name("syscall_probe.c")
PROBE_ENV = {"GPUCLOUD_PROBE_IN_CONTAINER": "1"}
EPERM, ENOSYS, EROFS = f"errno:{errno.EPERM}", f"errno:{errno.ENOSYS}", f"errno:{errno.EROFS}"


@pytest.fixture(scope="module")
def probe_rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.fail("needs gcc (Debian build-essential) to build the syscall probe",
                    pytrace=False)
    rootfs = make_busybox_rootfs(tmp_path_factory.mktemp("secure") / "rootfs")
    subprocess.run(["gcc", "-static", "-O1", "-o", str(rootfs / "bin" / "probe"),
                    str(PROBE_SOURCE)], check=True, capture_output=True)
    return rootfs


def _run(driver: RuncDriver, rootfs: Path, command: tuple[str, ...], *, cid: str = "sec",
         image: ImageConfig | None = None, without_seccomp: bool = False) -> str:
    spec = ContainerSpec(cid, "pod", command=command, env=PROBE_ENV)
    driver.build(spec, rootfs, image or ImageConfig())
    if without_seccomp:
        config_path = driver.paths(cid).config
        config = read_json(config_path)
        assert isinstance(config, dict)
        del config["linux"]["seccomp"]
        config_path.write_text(json.dumps(config))
    driver.start(cid)
    info = driver.wait(cid, timeout=15)
    assert info is not None, "container did not exit in time"
    log = driver.log_path(cid).read_text()
    driver.remove(cid)
    return log


def _probe(driver: RuncDriver, rootfs: Path, without_seccomp: bool = False
           ) -> dict[str, str]:
    log = _run(driver, rootfs, ("/bin/probe",), without_seccomp=without_seccomp)
    results = dict(line.split("=", 1) for line in log.splitlines() if "=" in line)
    assert len(results) >= 19, log
    return results


def _status(driver: RuncDriver, rootfs: Path, image: ImageConfig | None = None
            ) -> dict[str, str]:
    log = _run(driver, rootfs, ("cat", "/proc/self/status"), image=image)
    return {k: v.strip() for k, _, v in (line.partition(":") for line in log.splitlines())}


def test_escape_syscalls_are_refused_by_the_seccomp_profile(
        driver: RuncDriver, probe_rootfs: Path) -> None:
    got = _probe(driver, probe_rootfs)
    for name in ("unshare_user", "unshare_mount", "mount", "keyctl", "add_key",
                 "init_module", "finit_module", "bpf", "setns", "sethostname", "reboot",
                 "vsock_socket"):
        assert got[name] == EPERM, (name, got[name])
    assert got["clone3"] == ENOSYS  # Docker's choice: glibc then falls back to clone
    assert got["write_proc_sys"] == EROFS  # /proc/sys is read-only


def test_what_docker_allows_stays_allowed(driver: RuncDriver, probe_rootfs: Path) -> None:
    """CAP_NET_RAW is in Docker's set: raw and packet sockets work (ping, tcpdump), as do
    chroot (CAP_SYS_CHROOT) and the query form of personality."""
    got = _probe(driver, probe_rootfs)
    for name in ("raw_socket", "packet_socket", "tcp_socket", "chroot", "personality"):
        assert got[name] == "ok", (name, got[name])


def test_without_the_profile_the_same_probes_succeed(
        driver: RuncDriver, probe_rootfs: Path) -> None:
    """The control: the kernel and the capability set alone would let these through."""
    got = _probe(driver, probe_rootfs, without_seccomp=True)
    assert got["unshare_user"] == "ok"
    assert got["keyctl"] == "ok"
    assert got["clone3"] != ENOSYS


def test_capabilities_are_dockers_default_set(driver: RuncDriver, probe_rootfs: Path) -> None:
    status = _status(driver, probe_rootfs)
    for field in ("CapEff", "CapPrm", "CapBnd"):
        assert int(status[field], 16) == oci.DOCKER_DEFAULT_CAP_MASK, (field, status[field])
    assert int(status["CapInh"], 16) == 0 and int(status["CapAmb"], 16) == 0
    assert status["NoNewPrivs"] == "1"
    assert status["Seccomp"] == "2"  # filter mode


def test_a_non_root_user_has_no_capabilities(driver: RuncDriver, probe_rootfs: Path) -> None:
    status = _status(driver, probe_rootfs, ImageConfig(user="app"))
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
    assert int(status["CapBnd"], 16) == oci.DOCKER_DEFAULT_CAP_MASK


def test_kernel_interfaces_are_masked_or_read_only(
        driver: RuncDriver, probe_rootfs: Path) -> None:
    """Each masked path this kernel has reads as empty inside (a file: /dev/null bound on
    it; a directory: an empty read-only tmpfs); /proc/sys refuses writes; mount, insmod
    and unshare fail in a shell as they do in the probe."""
    masked = [path for path in oci.MASKED_PATHS if Path(path).exists()]
    assert masked, "this kernel has none of the masked paths"
    checks = [f"echo {path}=$(cat {path} 2>/dev/null | wc -c)$(ls -A {path} 2>/dev/null "
              "| wc -l)" if Path(path).is_dir() else
              f"echo {path}=$(wc -c < {path})" for path in masked]
    script = "; ".join([
        *checks,
        "echo x > /proc/sys/kernel/domainname 2>/dev/null && echo sys=written "
        "|| echo sys=refused",
        "mount -t tmpfs none /mnt 2>/dev/null && echo mount=ok || echo mount=refused",
        "insmod /lib/none.ko 2>/dev/null && echo insmod=ok || echo insmod=refused",
        "unshare -U true 2>/dev/null && echo unshare=ok || echo unshare=refused",
    ])
    log = _run(driver, probe_rootfs, ("sh", "-c", script))
    got = dict(line.split("=", 1) for line in log.split() if "=" in line)
    expected = {path: "00" if Path(path).is_dir() else "0" for path in masked}
    assert got == {**expected, "sys": "refused", "mount": "refused", "insmod": "refused",
                   "unshare": "refused"}, log


def test_the_profile_is_dockers_resolved_for_the_pod_capabilities() -> None:
    """Rules for capabilities pods lack (CAP_SYS_ADMIN, CAP_SYS_MODULE …) are dropped,
    those for the ones they hold (CAP_SYS_CHROOT) kept; the default refuses."""
    profile = oci.seccomp_profile()
    allowed = seccomp.allowed_syscalls(profile)
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    assert {"read", "write", "execve", "clone", "chroot", "ptrace"} <= allowed
    assert not {"mount", "unshare", "setns", "keyctl", "add_key", "init_module", "bpf",
                "reboot", "kexec_load", "open_by_handle_at"} & allowed
    everything = seccomp.profile(["CAP_SYS_ADMIN", "CAP_SYS_MODULE"])
    assert {"mount", "unshare", "init_module"} <= seccomp.allowed_syscalls(everything)
