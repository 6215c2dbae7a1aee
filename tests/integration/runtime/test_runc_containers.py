"""Real runc containers from a busybox rootfs, through the bundle builder and the driver."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from gpucloud.gpu.cdi import CdiRegistry, write_simulated_spec
from gpucloud.gpu.profiles import simulate
from gpucloud.runtime.bundle import ContainerSpec, ImageConfig
from gpucloud.runtime.demo import DEMO_SCRIPT
from gpucloud.runtime.driver import ContainerState, ExitInfo, RuncDriver
from gpucloud.runtime.errors import CommandNotFound, RuncError
from gpucloud.runtime.layout import read_json
from gpucloud.runtime.logs import read_from, tail
from tests.integration.runtime.runc_testing import cleanup, wait_until

pytestmark = pytest.mark.root

MiB = 1024 * 1024


def run(
    driver: RuncDriver, rootfs: Path, script: str, *, container_id: str = "c1",
    timeout: float = 15, image: ImageConfig | None = None, **spec_fields: Any,
) -> tuple[ExitInfo, str]:
    """Run ``sh -c script`` to completion; its exit and its log."""
    spec = ContainerSpec(container_id, "pod", command=("sh", "-c", script), **spec_fields)
    driver.build(spec, rootfs, image or ImageConfig())
    driver.start(container_id)
    info = driver.wait(container_id, timeout=timeout)
    assert info is not None, "container did not exit in time"
    return info, driver.log_path(container_id).read_text()


def start(driver: RuncDriver, rootfs: Path, script: str, container_id: str = "c1") -> None:
    driver.build(ContainerSpec(container_id, "pod", command=("sh", "-c", script)), rootfs,
                 ImageConfig())
    driver.start(container_id)


def test_exit_code_and_pid_1_is_the_command(driver: RuncDriver, busybox_rootfs: Path) -> None:
    info, log = run(driver, busybox_rootfs,
                    "echo pid=$$; tr '\\0' ' ' < /proc/1/cmdline; echo; echo oops >&2; exit 7")
    assert info.exit_code == 7 and info.signal is None and not info.oom_killed
    assert info.reason is None and not info.succeeded
    lines = log.splitlines()
    assert lines[0] == "pid=1"
    assert lines[1].startswith("sh -c echo pid=$$")
    assert "oops" in lines  # stderr goes to the same log


def test_entrypoint_and_cmd_resolution(driver: RuncDriver, busybox_rootfs: Path) -> None:
    image = ImageConfig(entrypoint=("echo", "entry"), cmd=("from-cmd",), env=("A=image", "B=image"),
                        working_dir="/tmp")
    spec = ContainerSpec("c1", "pod", env={"B": "pod"})
    driver.build(spec, busybox_rootfs, image)
    driver.start("c1")
    assert driver.wait("c1", timeout=10) == driver.status("c1").exit
    assert driver.log_path("c1").read_text() == "entry from-cmd\n"

    info, log = run(driver, busybox_rootfs, "echo $A $B $(pwd) $(id -u)", container_id="c2",
                    image=ImageConfig(env=("A=image", "B=image"), working_dir="/tmp", user="app"),
                    env={"B": "pod"})
    assert info.exit_code == 0
    assert log == "image pod /tmp 1000\n"


def test_gpu_env_and_gpus_json(driver: RuncDriver, busybox_rootfs: Path, tmp_path: Path) -> None:
    hardware = simulate("dgx-h100", "node-a")
    write_simulated_spec(tmp_path / "cdi", hardware)
    gpus = (hardware.gpus[2], hardware.gpus[5])
    edits = CdiRegistry.load([tmp_path / "cdi"]).edits_for_gpus(gpus)
    spec = ContainerSpec("c1", "pod", gpus=gpus, node_name="node-a", command=(
        "sh", "-c", "env | grep -E '^(NVIDIA|CUDA|GPUCLOUD)_' | sort; echo ---; "
                    "cat /run/gpucloud/gpus.json"))
    driver.build(spec, busybox_rootfs, ImageConfig(), edits)
    driver.start("c1")
    assert driver.wait("c1", timeout=10) is not None
    env_part, _, json_part = driver.log_path("c1").read_text().partition("---\n")
    uuids = f"{gpus[0].uuid},{gpus[1].uuid}"
    assert env_part.splitlines() == sorted([
        f"CUDA_VISIBLE_DEVICES={uuids}",
        "GPUCLOUD_SIMULATED_GPUS=dgx-h100",
        f"GPUCLOUD_SIM_GPU_2={gpus[0].uuid}",
        f"GPUCLOUD_SIM_GPU_5={gpus[1].uuid}",
        f"NVIDIA_VISIBLE_DEVICES={uuids}",
    ])
    document = json.loads(json_part)
    assert document["visible_devices"] == uuids
    assert [(g["index"], g["host_index"], g["uuid"]) for g in document["gpus"]] == [
        (0, 2, gpus[0].uuid), (1, 5, gpus[1].uuid)]
    assert document["gpus"][0]["nvlink_peers"] == [gpus[1].uuid]
    assert document["gpus"][0]["model"] == "H100-80GB"


def test_no_gpus_means_void(driver: RuncDriver, busybox_rootfs: Path) -> None:
    info, log = run(driver, busybox_rootfs,
                    'echo "$NVIDIA_VISIBLE_DEVICES|${CUDA_VISIBLE_DEVICES-unset}"; '
                    "cat /run/gpucloud/gpus.json")
    assert log.splitlines()[0] == "void|"
    assert json.loads(log.split("\n", 1)[1])["gpus"] == []


def test_memory_limit_is_enforced_as_oom_killed(
    driver: RuncDriver, busybox_rootfs: Path
) -> None:
    info, log = run(driver, busybox_rootfs,
                    "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null "
                    "|| cat /sys/fs/cgroup/memory.max; "
                    # At most 256 MiB, so that a limit that does not hold fails the test
                    # instead of exhausting the host.
                    "a=x; while [ ${#a} -lt 268435456 ]; do a=$a$a; done",
                    memory_bytes=32 * MiB)
    assert log.splitlines()[0] == str(32 * MiB)
    assert info.oom_killed and info.reason == "OOMKilled"
    assert info.exit_code == 137 and info.signal == 9


def test_cpu_quota_is_set(driver: RuncDriver, busybox_rootfs: Path) -> None:
    info, log = run(driver, busybox_rootfs,
                    "cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu/cpu.shares "
                    "2>/dev/null || cat /sys/fs/cgroup/cpu.max", cpu_milli=1500)
    assert info.exit_code == 0
    assert log.split() in (["150000", "1536"], ["150000", "100000"])


def test_stop_with_sigterm_handled(driver: RuncDriver, busybox_rootfs: Path) -> None:
    start(driver, busybox_rootfs,
          "trap 'echo got TERM; exit 3' TERM; echo ready; while true; do sleep 0.05; done")
    wait_until(lambda: b"ready" in tail(driver.log_path("c1"), 1), what="ready")
    driver.stop("c1", grace_seconds=20)
    info = driver.wait("c1", timeout=10)
    assert info is not None and info.exit_code == 3
    assert info.stop_requested and not info.killed_after_grace
    assert "got TERM" in driver.log_path("c1").read_text()


def test_stop_kills_after_grace_when_sigterm_ignored(
    driver: RuncDriver, busybox_rootfs: Path
) -> None:
    # PID 1 without a TERM handler ignores SIGTERM, as in any PID namespace.
    start(driver, busybox_rootfs, "echo ready; while true; do sleep 0.05; done")
    wait_until(lambda: b"ready" in tail(driver.log_path("c1"), 1), what="ready")
    asked = time.time()  # the clock of ``finished_at`` (the supervisor's)
    driver.stop("c1", grace_seconds=0.5)
    info = driver.wait("c1", timeout=10)
    assert info is not None and info.exit_code == 137 and info.signal == 9
    assert info.killed_after_grace and not info.oom_killed
    # Killed only once its grace was over: the exit is at least 0.5 s after the request
    # (however late this test is scheduled, which can only make the wait longer).
    assert info.finished_at is not None and info.finished_at - asked >= 0.5, info


def test_restarted_agent_adopts_running_container(
    driver: RuncDriver, busybox_rootfs: Path
) -> None:
    spec = ContainerSpec("pod-1-0", "pod", labels={"pod_id": "pod-1", "attempt": "0"},
                         command=("sh", "-c",
                                  "trap 'exit 0' TERM; i=0; while true; do i=$((i+1)); "
                                  "echo line $i; sleep 0.05; done"))
    driver.build(spec, busybox_rootfs, ImageConfig())
    first = driver.start("pod-1-0")
    assert first.state is ContainerState.RUNNING and first.pid
    state_dir = driver.state_dir
    del driver  # the agent goes away; its supervisor and container do not

    adopted = RuncDriver(state_dir)
    [status] = adopted.containers()
    assert status.state is ContainerState.RUNNING and status.pid == first.pid
    assert status.labels == {"pod_id": "pod-1", "attempt": "0"}
    log = adopted.log_path("pod-1-0")
    offset = read_from(log, 0).next_offset
    wait_until(lambda: read_from(log, offset).data.count(b"\n") >= 3,
               what="new log lines after adoption")
    adopted.stop("pod-1-0", grace_seconds=10)
    info = adopted.wait("pod-1-0", timeout=10)
    assert info is not None and info.exit_code == 0 and info.stop_requested
    assert RuncDriver(adopted.state_dir).status("pod-1-0").exit == info


def test_private_network_has_loopback_up_and_host_network_shares(
    driver: RuncDriver, busybox_rootfs: Path
) -> None:
    script = "ls /sys/class/net | tr '\\n' ' '; echo; cat /sys/class/net/lo/flags"
    _, private = run(driver, busybox_rootfs, script, container_id="private")
    assert private.splitlines()[0].split() == ["lo"]
    assert int(private.splitlines()[1], 16) & 0x1  # IFF_UP
    before = _host_interfaces()
    _, shared = run(driver, busybox_rootfs, script, container_id="host", host_network=True)
    after = _host_interfaces()
    seen = set(shared.splitlines()[0].split())
    # other tests running beside this one add and remove veths meanwhile: the container
    # sees every interface the host had throughout, and none the host never had
    assert before & after <= seen <= before | after
    assert seen - {"lo"}, seen  # the host's own, not a namespace of its own


def test_a_bundle_built_by_an_earlier_driver_still_gets_loopback_up(
    driver: RuncDriver, busybox_rootfs: Path
) -> None:
    """The driver that built a bundle tells its supervisor whether the network namespace
    is the container's own (s46); one that did not build it (the agent restarted between
    the bundle and the start) leaves the supervisor to read the bundle, as before."""
    script = "cat /sys/class/net/lo/flags"
    spec = ContainerSpec("built-before", "pod", command=("sh", "-c", script))
    driver.build(spec, busybox_rootfs, ImageConfig())
    restarted = RuncDriver(driver.state_dir, runc=driver.runc, zygote=False)
    restarted.start("built-before")
    info = restarted.wait("built-before", timeout=15)
    assert info is not None and info.exit_code == 0
    assert int(restarted.log_path("built-before").read_text(), 16) & 0x1  # IFF_UP


def _host_interfaces() -> set[str]:
    return {path.name for path in Path("/sys/class/net").iterdir()}


def test_command_not_found(driver: RuncDriver, busybox_rootfs: Path) -> None:
    spec = ContainerSpec("c1", "pod", command=("no-such-tool", "--help"))
    with pytest.raises(CommandNotFound, match="^command not found: no-such-tool$"):
        driver.build(spec, busybox_rootfs, ImageConfig())


def test_runc_refusal_is_a_clear_error(driver: RuncDriver, busybox_rootfs: Path) -> None:
    spec = ContainerSpec("c1", "pod", command=("true",), working_dir="/bin/busybox")
    driver.build(spec, busybox_rootfs, ImageConfig())
    with pytest.raises(RuncError, match="container failed to start: .*not a directory"):
        driver.start("c1")
    status = driver.status("c1")
    assert status.state is ContainerState.EXITED and status.exit is not None
    assert status.exit.exit_code is None and "not a directory" in (status.exit.reason or "")


def test_demo_program_prints_its_gpus(
    driver: RuncDriver, busybox_rootfs: Path, tmp_path: Path
) -> None:
    rootfs = tmp_path / "demo-rootfs"
    shutil.copytree(busybox_rootfs, rootfs, symlinks=True)
    (rootfs / "usr" / "local" / "bin").mkdir(parents=True)
    shutil.copy2(DEMO_SCRIPT, rootfs / "usr" / "local" / "bin" / "gpucloud-demo")
    hardware = simulate("rtx4090-2", "node-b")
    spec = ContainerSpec("demo", "hello", command=("gpucloud-demo",), gpus=hardware.gpus)
    driver.build(spec, rootfs, ImageConfig())
    driver.start("demo")
    info = driver.wait("demo", timeout=10)
    log = driver.log_path("demo").read_text()
    assert info is not None and info.exit_code == 0, log
    assert "2 GPU(s) assigned:" in log
    for gpu in hardware.gpus:
        assert f"  GPU {gpu.index}: {gpu.uuid} RTX4090, 24564 MiB, NUMA node 0 (simulated)" in log
    assert "environment and /run/gpucloud/gpus.json agree" in log


def _gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie counts: its command line is empty)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes() == b""
    except FileNotFoundError:
        return True


def test_container_outlives_a_killed_supervisor_and_can_still_be_stopped(
    driver: RuncDriver, busybox_rootfs: Path
) -> None:
    start(driver, busybox_rootfs, "while true; do echo tick; sleep 0.05; done")
    supervisor = read_json(driver.paths("c1").supervisor_pid)
    os.kill(supervisor, signal.SIGKILL)
    wait_until(lambda: _gone(supervisor), what="supervisor gone")
    assert driver.status("c1").state is ContainerState.RUNNING  # runc still has it
    offset = read_from(driver.log_path("c1"), 0).next_offset
    wait_until(lambda: read_from(driver.log_path("c1"), offset).data != b"", what="more output")
    driver.stop("c1", grace_seconds=0.2)  # without a supervisor: enforced by the driver
    wait_until(lambda: driver.status("c1").state is ContainerState.LOST, what="lost")
    assert driver.status("c1").exit is None  # nobody was there to see the exit status


def test_two_agents_run_the_same_container_id_side_by_side(
    driver: RuncDriver, busybox_rootfs: Path, tmp_path: Path
) -> None:
    other = RuncDriver(tmp_path / "other-agent")
    try:
        for agent, word in ((driver, "first"), (other, "second")):
            start(agent, busybox_rootfs,
                  f"trap 'exit 0' TERM; echo {word}; while true; do sleep 0.05; done")
        assert {driver.status("c1").state, other.status("c1").state} == {ContainerState.RUNNING}
        for agent, word in ((driver, "first"), (other, "second")):
            # Its trap is set once it printed (PID 1 ignores a TERM it has no handler for).
            def printed(a: RuncDriver = agent) -> bool:
                return a.log_path("c1").read_bytes() != b""

            wait_until(printed, what="output")
            agent.stop("c1", grace_seconds=10)
            info = agent.wait("c1", timeout=10)
            assert info is not None and info.exit_code == 0
            assert agent.log_path("c1").read_text() == f"{word}\n"
    finally:
        cleanup(other)
