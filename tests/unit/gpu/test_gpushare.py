"""GPU sharing (MPS through its control pipe), dmem, sysfs PCI facts and XID health."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from gpucloud.gpu.dmem import dmem_regions, dmem_unified
from gpucloud.gpu.domain import GpuDevice
from gpucloud.gpu.health import (
    Fault,
    HealthTracker,
    InjectedFaults,
    XidAction,
    classify_xid,
    kernel_log_xids,
    parse_injected,
)
from gpucloud.gpu.mps import GpuSharing, ProcessMpsControl, SimulatedMpsControl
from gpucloud.gpu.pci import pci_facts, switch_numbers

GPU = GpuDevice(index=0, uuid="GPU-aaaa", model="H100-80GB", memory_mib=81559,
                pci_bus_id="0000:18:00.0")


@pytest.mark.parametrize(("xid", "action"), [
    (79, XidAction.NODE), (74, XidAction.NODE),
    *[(x, XidAction.GPU_RESET) for x in (46, 48, 62, 64, 95, 109, 110, 119, 120)],
    (94, XidAction.APPLICATION), (63, XidAction.INFO), (92, XidAction.INFO),
    (31, XidAction.APPLICATION), (999, XidAction.INFO),
])
def test_xid_classes_follow_the_catalog(xid: int, action: XidAction) -> None:
    assert classify_xid(xid) is action


def test_kernel_log_xids_name_the_bus_and_code() -> None:
    text = ("[ 12.3] NVRM: Xid (PCI:0000:18:00): 79, pid=0, GPU has fallen off the bus.\n"
            "[ 13.0] other line\n[ 14.1] NVRM: Xid (PCI:0000:2a:00): 63, pid=12, ...\n")
    assert kernel_log_xids(text) == [("0000:18:00.0", 79), ("0000:2a:00.0", 63)]


def test_injected_faults_parse_and_reject() -> None:
    assert parse_injected("GPU3:xid79") == Fault(3, xid=79)
    assert parse_injected("gpu1:ecc") == Fault(1, check="ecc")
    with pytest.raises(ValueError, match="GPU<N>:xid"):
        parse_injected("GPU3:79")


def test_tracker_takes_out_only_the_gpu_and_recovers_with_hysteresis(tmp_path: Path) -> None:
    faults = tmp_path / "faults"
    injected = InjectedFaults(path=faults)
    tracker = HealthTracker(("GPU-0", "GPU-1"), recovery_checks=2)
    faults.write_text("GPU1:xid48\nGPU0:xid94\n")
    report = tracker.update(injected.read())
    assert [g.healthy for g in report.gpus] == [True, False]
    assert report.node_fault is None and "XID 48" in str(report.gpus[1].reason)
    faults.write_text("")  # the simulated reset
    assert not tracker.update(injected.read()).gpus[1].healthy  # one clean check: not yet
    assert tracker.update(injected.read()).gpus[1].healthy


def test_xid79_is_a_node_fault_until_clean_twice() -> None:
    tracker = HealthTracker(("GPU-0",) * 4)
    report = tracker.update([Fault(3, xid=79)])
    assert report.node_fault == "GPU3: XID 79 (node)" and not report.gpus[3].healthy
    assert tracker.update([]).node_fault is not None
    assert tracker.update([]).node_fault is None


def _fake_control(tmp_path: Path) -> tuple[str, Path]:
    """A stand-in ``nvidia-cuda-mps-control``: records argv, pipe dir and stdin."""
    record = tmp_path / "calls.jsonl"
    script = tmp_path / "nvidia-cuda-mps-control"
    script.write_text(f"""#!/usr/bin/env python3
import json, os, sys
data = "" if "-d" in sys.argv else sys.stdin.read()
with open({str(record)!r}, "a") as out:
    out.write(json.dumps({{"argv": sys.argv[1:], "pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "stdin": data}}) + "\\n")
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), record


def test_mps_command_sequence_through_the_control_pipe(tmp_path: Path) -> None:
    binary, record = _fake_control(tmp_path)
    modes: list[bool] = []
    control = ProcessMpsControl(lambda gpu, exclusive: modes.append(exclusive), binary)
    sharing = GpuSharing("mps", tmp_path / "state", control)
    grant = sharing.admit("pod-a-1", GPU, 500, 20 * 1024**3)
    sharing.admit("pod-b-1", GPU, 250, None)
    sharing.release("pod-a-1")
    sharing.release("pod-b-1")
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    pipe = str(tmp_path / "state" / "mps" / "GPU-aaaa" / "pipe")
    assert [(c["argv"], c["stdin"].strip()) for c in calls] == [
        (["-d"], ""),
        ([], "set_default_active_thread_percentage 50"),
        ([], "set_default_device_pinned_mem_limit 0 20480M"),
        ([], "set_default_active_thread_percentage 25"),
        ([], "quit"),
    ]
    assert {c["pipe"] for c in calls} == {pipe} and calls[0]["visible"] == "GPU-aaaa"
    assert modes == [True, False]  # EXCLUSIVE_PROCESS while the daemon runs, then DEFAULT
    assert grant.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert grant.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    assert grant.env["GPUCLOUD_GPU_SHARE"] == "0.5"
    assert grant.env["GPUCLOUD_GPU_MEMORY_LIMIT"] == str(20 * 1024**3)
    assert (Path(pipe), "/tmp/nvidia-mps") in grant.binds


def test_time_slicing_sets_no_limits(tmp_path: Path) -> None:
    sharing = GpuSharing("time-slicing", tmp_path, SimulatedMpsControl())
    grant = sharing.admit("pod-1", GPU, 500, None)
    assert not grant.binds and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in grant.env
    assert grant.env["GPUCLOUD_GPU_SHARING"] == "time-slicing"
    assert not (tmp_path / "mps").exists()


def test_dmem_only_with_controller_and_region(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    (tmp_path / "dmem.capacity").write_text("drm/0000:18:00.0/vram0 85899345920\n")
    assert dmem_regions(tmp_path) == {}
    (tmp_path / "cgroup.controllers").write_text("cpu memory dmem pids\n")
    regions = dmem_regions(tmp_path)
    assert dmem_unified(regions, GPU, 1024) == {"dmem.max": "drm/0000:18:00.0/vram0 1024"}
    assert dmem_unified(regions, GPU, 1024, mig=True) == {}
    other = GPU.model_copy(update={"pci_bus_id": "0000:2a:00.0"})
    assert dmem_unified(regions, other, 1024) == {}


def _pci_fixture(sysfs: Path) -> None:
    """Two GPUs behind one switch (upstream 16:00.0), one on a root port directly."""
    devices = sysfs / "devices" / "pci0000:15"
    paths = {
        "0000:18:00.0": devices / "0000:15:01.0" / "0000:16:00.0" / "0000:17:00.0"
        / "0000:18:00.0",
        "0000:19:00.0": devices / "0000:15:01.0" / "0000:16:00.0" / "0000:17:01.0"
        / "0000:19:00.0",
        "0000:2a:00.0": devices / "0000:15:02.0" / "0000:2a:00.0",
    }
    links = sysfs / "bus" / "pci" / "devices"
    links.mkdir(parents=True)
    for group, (bus, path) in enumerate(paths.items(), start=30):
        path.mkdir(parents=True)
        (path / "numa_node").write_text("1\n")
        iommu = sysfs / "kernel" / "iommu_groups" / str(group)
        iommu.mkdir(parents=True)
        os.symlink(iommu, path / "iommu_group")
        os.symlink(path, links / bus)


def test_sysfs_pci_facts(tmp_path: Path) -> None:
    _pci_fixture(tmp_path)
    first, second, alone = (pci_facts(bus, tmp_path) for bus in
                            ("0000:18:00.0", "00000000:19:00.0", "0000:2a:00.0"))
    assert (first.numa_node, first.switch, first.iommu_group) == (1, "0000:16:00.0", 30)
    assert (second.switch, second.iommu_group) == ("0000:16:00.0", 31)
    assert (alone.switch, alone.iommu_group) == (None, 32)
    assert switch_numbers([first.switch, second.switch, alone.switch]) == [0, 0, None]
    missing = pci_facts("0000:99:00.0", tmp_path)
    assert (missing.numa_node, missing.switch, missing.iommu_group) == (None, None, None)
