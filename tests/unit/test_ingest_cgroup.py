"""Where usage ingest's cpu cgroup goes (api/ingest_cgroup.py): found from a process's
/proc/PID/cgroup and mountinfo, on cgroup v1, v2 and hybrid hosts."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpucloud.api.ingest_cgroup import PREFIX, Hierarchy, find_hierarchy, open_group

V1_MOUNTS = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw"""
V2_MOUNTS = "30 23 0:27 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"
BOUND_V1 = "32 31 0:29 /docker/abc /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu"


@pytest.mark.parametrize(("cgroups", "mounts", "expected"), [
    # hybrid (this project's CI host): v1's cpu hierarchy, not the controller-less v2
    ("4:memory:/x\n2:cpu,cpuacct:/system.slice/gpucloud.service\n0::/user.slice",
     V1_MOUNTS, Hierarchy(Path("/sys/fs/cgroup/cpu,cpuacct/system.slice/gpucloud.service"),
                          1)),
    ("1:cpu:/\n0::/", V1_MOUNTS.replace("cpu,cpuacct", "cpu"),
     Hierarchy(Path("/sys/fs/cgroup/cpu"), 1)),
    ("0::/", V2_MOUNTS, Hierarchy(Path("/sys/fs/cgroup"), 2)),
    ("0::/system.slice/gpucloud.service", V2_MOUNTS,
     Hierarchy(Path("/sys/fs/cgroup/system.slice/gpucloud.service"), 2)),
    # a container that sees its own subtree mounted at the hierarchy's place
    ("2:cpu:/docker/abc/app", BOUND_V1, Hierarchy(Path("/sys/fs/cgroup/cpu/app"), 1)),
    ("2:cpu:/elsewhere", BOUND_V1, None),  # outside what is mounted
    ("2:cpu:/", V2_MOUNTS, None),  # the cpu hierarchy is not mounted
    ("", V1_MOUNTS, None),
])
def test_the_cpu_cgroup_is_found_from_proc(cgroups: str, mounts: str,
                                           expected: Hierarchy | None) -> None:
    assert find_hierarchy(cgroups, mounts) == expected


def _proc(tmp_path: Path, pid: int, hierarchy: Path) -> Path:
    proc = tmp_path / "proc"
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cgroup").write_text("0::/\n")
    (proc / str(pid) / "mountinfo").write_text(
        f"30 23 0:27 / {hierarchy} rw - cgroup2 cgroup2 rw\n")
    return proc


def test_a_group_is_made_beside_the_worker_and_groups_of_dead_workers_go(
        tmp_path: Path) -> None:
    hierarchy = tmp_path / "cgroup"
    (hierarchy / f"{PREFIX}999999").mkdir(parents=True)  # a worker that died
    (hierarchy / f"{PREFIX}77").mkdir()  # a live one's (pid 77 below)
    proc = _proc(tmp_path, 77, hierarchy)
    (proc / "42").mkdir()
    (proc / "42" / "cgroup").write_text("0::/\n")
    (proc / "42" / "mountinfo").write_text((proc / "77" / "mountinfo").read_text())
    # a plain directory has no cpu.weight file: no cpu controller, so no group
    assert open_group(42, proc) is None
    assert not (hierarchy / f"{PREFIX}42").exists()
    assert not (hierarchy / f"{PREFIX}999999").exists()
    assert (hierarchy / f"{PREFIX}77").exists()
