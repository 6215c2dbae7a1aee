"""The node's volume disks: measuring, limits, keeping and deleting, mount sources."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpucloud.agent.volumes import (
    DiskLimit,
    VolumeStore,
    default_volume_mode,
    disk_usage,
    project_quota_tool,
)
from gpucloud.core.access import NetworkVolumeMount
from gpucloud.core.models import AssignmentOut
from gpucloud.core.phases import PodPhase
from gpucloud.runtime.bundle import BindMount
from gpucloud.runtime.errors import RuntimeFailure

MIB = 1024**2


def _assignment(**fields: object) -> AssignmentOut:
    base: dict[str, object] = {
        "pod_id": "ab" * 16, "name": "dev", "project": "p", "attempt": 1,
        "desired_state": "running", "phase": PodPhase.SCHEDULED, "image": "busybox",
        "command": [], "env": {}, "ports": [], "cpu_milli": 1000, "memory_bytes": MIB * 64,
        "gpu_uuids": []}
    return AssignmentOut.model_validate(base | fields)


def _write(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as file:
        file.write(os.urandom(size))
        file.flush()
        os.fsync(file.fileno())


@pytest.mark.parametrize(("url", "mode"), [
    ("http://127.0.0.1:8000", "hostpath"), ("http://localhost:1", "hostpath"),
    ("https://[::1]:8443", "hostpath"), ("http://10.0.0.5:8000", "nfs"),
    ("https://cloud.example.com", "nfs"),
])
def test_default_volume_mode_follows_the_server_url(url: str, mode: str) -> None:
    assert default_volume_mode(url) == mode


def test_disk_usage_counts_allocated_bytes_and_hard_links_once(tmp_path: Path) -> None:
    _write(tmp_path / "a" / "big", 3 * MIB)
    os.link(tmp_path / "a" / "big", tmp_path / "link")
    (tmp_path / "sym").symlink_to("/usr")
    used = disk_usage(tmp_path)
    assert 3 * MIB <= used < 3 * MIB + 256 * 1024
    assert disk_usage(tmp_path / "missing") == 0


def test_disk_limit_names_the_disk_and_both_sizes(tmp_path: Path) -> None:
    limit = DiskLimit("VolumeFull", "volume /workspace", tmp_path, 2 * MIB)
    assert limit.excess() is None
    _write(tmp_path / "x", 3 * MIB)
    message = limit.excess()
    assert message is not None and message.startswith("volume /workspace uses 3")
    assert "of 2Mi; the pod was stopped" in message


def test_binds_make_the_volume_disk_once_and_keep_its_files(tmp_path: Path) -> None:
    store = VolumeStore(tmp_path, "http://127.0.0.1:1", "hostpath")
    assignment = _assignment(volume_bytes=20 * MIB, volume_path="/data")
    (bind,) = store.binds(assignment)
    assert bind == BindMount(tmp_path / "volumes" / assignment.pod_id, "/data")
    (bind.source / "x").write_text("kept")
    store.binds(assignment)
    assert (bind.source / "x").read_text() == "kept"
    assert store.binds(_assignment()) == ()


def test_hostpath_network_volume_binds_the_server_directory(tmp_path: Path) -> None:
    store = VolumeStore(tmp_path / "agent", "http://127.0.0.1:1", "hostpath")
    shared = tmp_path / "server" / "volumes" / "v1"
    mount = NetworkVolumeMount(name="data", volume_id="v1", path="/data", mode="hostpath",
                               source=str(shared))
    with pytest.raises(RuntimeFailure, match="is not a directory on this node"):
        store.binds(_assignment(network_volumes=[mount]))
    shared.mkdir(parents=True)
    assert store.binds(_assignment(network_volumes=[mount])) == (BindMount(shared, "/data"),)


def test_collect_deletes_only_unlisted_idle_disks(tmp_path: Path) -> None:
    store = VolumeStore(tmp_path, "http://127.0.0.1:1", "hostpath")
    for pod in ("kept", "busy", "gone"):
        (store.disk(pod) / "f").parent.mkdir(parents=True)
    assert store.collect(["kept"], busy=["busy"]) == ["gone"]
    assert sorted(p.name for p in store.root.iterdir()) == ["busy", "kept"]
    assert store.collect([], busy=[]) == ["busy", "kept"]


def test_limits_cover_the_sized_disks(tmp_path: Path) -> None:
    store = VolumeStore(tmp_path, "http://127.0.0.1:1", "hostpath")
    layer = tmp_path / "upper"
    limits = store.limits(_assignment(volume_bytes=5 * MIB, container_disk_bytes=7 * MIB),
                          layer)
    assert [(x.reason, x.what, x.path, x.limit_bytes) for x in limits] == [
        ("VolumeFull", "volume /workspace", store.disk("ab" * 16), 5 * MIB),
        ("ContainerDiskFull", "container disk", layer, 7 * MIB)]
    assert store.limits(_assignment(), layer) == []


def test_no_project_quota_without_the_mount_option(tmp_path: Path) -> None:
    options = Path("/proc/self/mountinfo").read_text()
    if "prjquota" in options or "pquota" in options:
        pytest.skip("this machine mounts a file system with project quotas")
    assert project_quota_tool(tmp_path) is None
