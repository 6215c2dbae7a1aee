"""Usage sampling on the node: cgroup v1 and v2 parsers over kernel-format fixture files,
netns counters, the simulated GPU model, NVML attribution over a stand-in driver, the
spool across crashes, and the reporter's handling of refusals."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpucloud.agent.usage import (
    PodSampler,
    Target,
    cgroup_pids,
    cgroup_usage,
    net_bytes,
    parse_net_dev,
    read_cgroup_v1,
    read_cgroup_v2,
)
from gpucloud.agent.usage_spool import UsageSpool
from gpucloud.core.usage import UsageSample
from gpucloud.gpu.domain import GpuDevice
from gpucloud.gpu.usage import NvmlGpuUsage, SimulatedGpuUsage, declared_util

DATA = Path(__file__).parent / "data"
T0 = datetime(2026, 3, 1, tzinfo=UTC)


def _gpu(index: int, memory_mib: int = 81559) -> GpuDevice:
    return GpuDevice(index=index, uuid=f"GPU-{index:04d}", model="H100-80GB",
                     memory_mib=memory_mib)


def _host(tmp_path: Path, version: int, pid: int = 4242) -> tuple[Path, Path]:
    """A /proc and mountinfo naming the fixture cgroups (copied under ``tmp_path``)."""
    root = tmp_path / "cgroup"
    shutil.copytree(DATA / f"cgroup-v{version}", root / "pods" / "p1")
    proc = tmp_path / "proc"
    (proc / str(pid) / "net").mkdir(parents=True)
    shutil.copy(DATA / "net-dev", proc / str(pid) / "net" / "dev")
    if version == 1:
        (root / "cpuacct").mkdir()
        shutil.move(root / "pods" / "p1" / "cpuacct", root / "cpuacct" / "p1")
        shutil.move(root / "pods" / "p1" / "memory", root / "memory-p1")
        (root / "memory").mkdir()
        shutil.move(root / "memory-p1", root / "memory" / "p1")
        (proc / str(pid) / "cgroup").write_text("5:memory:/p1\n3:cpu,cpuacct:/p1\n0::/\n")
        mountinfo = (f"32 31 0:29 / {root}/cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
                     f"35 31 0:32 / {root}/memory rw - cgroup cgroup rw,memory\n")
    else:
        (proc / str(pid) / "cgroup").write_text("0::/pods/p1\n")
        mountinfo = f"41 31 0:38 / {root} rw - cgroup2 cgroup2 rw\n"
    (tmp_path / "mountinfo").write_text(mountinfo)
    return proc, tmp_path / "mountinfo"


def test_cgroup_v1_counters_working_set_and_peak() -> None:
    usage = read_cgroup_v1(DATA / "cgroup-v1" / "cpuacct", DATA / "cgroup-v1" / "memory")
    assert usage is not None
    assert usage.cpu_seconds == pytest.approx(2.5)
    assert usage.memory_bytes == 104857600 - 4194304  # usage less inactive file pages
    assert usage.memory_peak_bytes == 157286400


def test_cgroup_v2_counters_working_set_and_peak() -> None:
    usage = read_cgroup_v2(DATA / "cgroup-v2")
    assert usage is not None
    assert usage.cpu_seconds == pytest.approx(7.25)
    assert usage.memory_bytes == 209715200 - 8388608
    assert usage.memory_peak_bytes == 314572800


def test_a_removed_cgroup_reads_none(tmp_path: Path) -> None:
    assert read_cgroup_v2(tmp_path) is None
    assert read_cgroup_v1(tmp_path, tmp_path) is None


@pytest.mark.parametrize(("version", "cpu", "pids"), [(1, 2.5, [12345, 12400]),
                                                      (2, 7.25, [777])])
def test_the_containers_cgroup_is_found_from_its_pid(tmp_path: Path, version: int,
                                                     cpu: float, pids: list[int]) -> None:
    proc, mountinfo = _host(tmp_path, version)
    usage = cgroup_usage(4242, proc, mountinfo)
    assert usage is not None and usage.cpu_seconds == pytest.approx(cpu)
    assert cgroup_pids(4242, proc, mountinfo) == pids


def test_netns_counters_leave_out_loopback(tmp_path: Path) -> None:
    assert parse_net_dev((DATA / "net-dev").read_text()) == (124456, 65932)
    proc, _ = _host(tmp_path, 2)
    assert net_bytes(4242, proc) == (124456, 65932)
    assert net_bytes(999, proc) is None


def test_the_simulated_gpu_model_is_its_declared_load() -> None:
    gpus = [_gpu(0), _gpu(1, memory_mib=1000)]
    read = SimulatedGpuUsage().sample(gpus, {"GPUCLOUD_SIM_GPU_UTIL": "50"}, [], True)
    assert [g.util_percent for g in read] == [50.0, 50.0]
    assert read[1].memory_used_bytes == 500 * 1024 * 1024
    assert SimulatedGpuUsage().sample(gpus, {}, [], True)[0].util_percent == 0.0
    assert [declared_util({"GPUCLOUD_SIM_GPU_UTIL": v}) for v in ("250", "-3", "x", "nan")] \
        == [100.0, 0.0, 0.0, 0.0]


class _NotFound(Exception):
    pass


class _Driver:
    """A stand-in for the NVML library: two GPUs, processes 10 and 11 of our pod and 99
    of another pod on the shared GPU-0001."""

    NVMLError = Exception
    NVMLError_NotFound = _NotFound

    def __init__(self) -> None:
        self.since: list[int] = []

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return uuid

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> SimpleNamespace:
        return SimpleNamespace(gpu=87, memory=20)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> SimpleNamespace:
        return SimpleNamespace(used=3 << 30, total=80 << 30)

    def nvmlDeviceGetProcessUtilization(self, handle: str, since: int) -> list[Any]:
        self.since.append(since)
        if since >= 300:
            raise _NotFound
        return [SimpleNamespace(pid=10, smUtil=30, timeStamp=100),
                SimpleNamespace(pid=10, smUtil=10, timeStamp=200),
                SimpleNamespace(pid=11, smUtil=5, timeStamp=300),
                SimpleNamespace(pid=99, smUtil=60, timeStamp=250)]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:
        return [SimpleNamespace(pid=10, usedGpuMemory=1 << 30),
                SimpleNamespace(pid=99, usedGpuMemory=7 << 30)]


def test_nvml_whole_gpus_read_the_device_shared_ones_the_pods_processes() -> None:
    driver = _Driver()
    nvml = NvmlGpuUsage(driver)
    [whole] = nvml.sample([_gpu(0)], {}, [10], True)
    assert whole.util_percent == 87.0 and whole.memory_used_bytes == 3 << 30
    [shared] = nvml.sample([_gpu(1)], {}, [10, 11], False)
    assert shared.util_percent == pytest.approx(20 + 5)  # pid 10: mean of 30, 10
    assert shared.memory_used_bytes == 1 << 30
    [idle] = nvml.sample([_gpu(1)], {}, [10, 11], False)
    assert idle.util_percent == 0.0 and driver.since == [0, 300]  # only what is new


def _sample(seq: int, pod: str = "p1", attempt: int = 1) -> UsageSample:
    return UsageSample(pod_id=pod, attempt=attempt, seq=seq, time=T0 + timedelta(seconds=seq),
                       cpu_seconds=seq * 0.5, memory_bytes=100, memory_peak_bytes=100)


def test_the_spool_keeps_unacknowledged_samples_across_a_restart(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path)
    for _ in range(5):
        spool.append("p1-1", _sample)
    spool.append("p2-1", lambda seq: _sample(seq, "p2"))
    spool.acknowledge("p1-1", 2)
    again = UsageSpool(tmp_path)
    assert [s.seq for s in again.pending_of("p1-1")] == [3, 4]
    assert [(s.pod_id, s.seq) for s in again.pending(10)] == [("p1", 3), ("p1", 4), ("p2", 0)]
    assert again.append("p1-1", _sample).seq == 5  # sequence numbers never repeat
    again.acknowledge("p1-1", 5)
    third = UsageSpool(tmp_path)
    assert third.pending_of("p1-1") == [] and third.append("p1-1", _sample).seq == 6


def test_a_torn_last_line_is_dropped_and_acknowledged_lines_are_not_resent(
    tmp_path: Path,
) -> None:
    spool = UsageSpool(tmp_path)
    for _ in range(3):
        spool.append("p1-1", _sample)
    with (tmp_path / "p1-1.jsonl").open("a") as out:
        out.write('{"pod_id": "p1", "attem')  # SIGKILL in the middle of a write
    (tmp_path / "p1-1.state").write_text('{"next_seq": 3, "acked": 0}')  # saved, not yet
    again = UsageSpool(tmp_path)                                          # rewritten
    assert [s.seq for s in again.pending_of("p1-1")] == [1, 2]
    assert again.append("p1-1", _sample).seq == 3
    lines = (tmp_path / "p1-1.jsonl").read_text().splitlines()
    assert [UsageSample.model_validate_json(line).seq for line in lines] == [1, 2, 3]


def test_forget_removes_a_finished_containers_spool(tmp_path: Path) -> None:
    spool = UsageSpool(tmp_path)
    spool.append("p1-1", _sample)
    spool.acknowledge("p1-1", 0)
    spool.forget("p1-1")
    assert list(tmp_path.iterdir()) == [] and spool.containers() == []


def test_the_sampler_keeps_the_peak_and_measures_disks_at_their_interval(
    tmp_path: Path,
) -> None:
    proc, mountinfo = _host(tmp_path, 2)
    volume = tmp_path / "volume"
    volume.mkdir()
    now = [T0]
    sampler = PodSampler(SimulatedGpuUsage(), disk_interval=30, proc=proc,
                         mountinfo=mountinfo, clock=lambda: now[0])
    target = Target(cid="p1-1", pod_id="p1", attempt=1, pid=4242, gpus=(_gpu(0),),
                    env={"GPUCLOUD_SIM_GPU_UTIL": "50"}, exclusive_gpus=True,
                    own_netns=True, volume_dir=volume)
    first = sampler.sample(target, 0)
    assert first is not None and first.net_rx_bytes == 124456
    assert first.memory_peak_bytes == 314572800 and first.gpus[0].util_percent == 50.0
    (volume / "data").write_bytes(b"x" * 65536)
    now[0] = T0 + timedelta(seconds=5)
    assert sampler.sample(target, 1).disk_bytes == first.disk_bytes  # type: ignore[union-attr]
    now[0] = T0 + timedelta(seconds=31)
    later = sampler.sample(target, 2)
    assert later is not None and later.disk_bytes is not None
    assert first.disk_bytes is not None and later.disk_bytes >= first.disk_bytes + 65536
    (tmp_path / "cgroup" / "pods" / "p1" / "memory.peak").unlink()  # an older kernel
    (tmp_path / "cgroup" / "pods" / "p1" / "memory.current").write_text("1000\n")
    assert sampler.sample(target, 3).memory_peak_bytes == 314572800  # type: ignore[union-attr]
