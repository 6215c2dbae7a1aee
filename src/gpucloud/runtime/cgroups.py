"""Finding a process's memory cgroup and whether the OOM killer struck in it.

Works with cgroup v1 (``memory.oom_control`` → ``oom_kill``, kernel 4.13+; older kernels
fall back to ``memory.failcnt``) and v2 (``memory.events`` → ``oom_kill``). Standard library
only: the supervisor imports this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class _Mount:
    root: str
    mount_point: str
    fstype: str
    super_options: frozenset[str]


def _mounts(mountinfo: Path) -> list[_Mount]:
    mounts = []
    for line in mountinfo.read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3:
            mounts.append(_Mount(fields[3], fields[4], tail[0], frozenset(tail[2].split(","))))
    return mounts


def _host_path(mount: _Mount, cgroup: str) -> Path:
    relative = os.path.relpath(cgroup, mount.root) if mount.root != "/" else cgroup.lstrip("/")
    return Path(mount.mount_point) / ("" if relative == "." else relative)


def memory_cgroup_dir(
    pid: int, proc: Path = Path("/proc"), mountinfo: Path = Path("/proc/self/mountinfo")
) -> Path | None:
    """The directory of ``pid``'s memory cgroup (v1 memory controller, else v2)."""
    return cgroup_dir(pid, "memory", proc, mountinfo)


def cgroup_dir(
    pid: int, controller: str, proc: Path = Path("/proc"),
    mountinfo: Path = Path("/proc/self/mountinfo"),
) -> Path | None:
    """The directory of ``pid``'s cgroup for ``controller`` (``memory``, ``cpuacct`` …):
    the v1 hierarchy with that controller, else the v2 (unified) one."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
        mounts = _mounts(mountinfo)
    except OSError:
        return None
    entries = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    for _, controllers, path in entries:
        if controller in controllers.split(","):
            for mount in mounts:
                if mount.fstype == "cgroup" and controller in mount.super_options:
                    return _host_path(mount, path)
    for hierarchy, controllers, path in entries:
        if hierarchy == "0" and controllers == "":
            for mount in mounts:
                if mount.fstype == "cgroup2":
                    return _host_path(mount, path)
    return None


def _counter(path: Path, key: str) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def _plain_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def oom_killed(memory_dir: Path | None, killed_by_sigkill: bool) -> bool:
    """Whether the kernel OOM killer killed a process in this memory cgroup.

    With an ``oom_kill`` counter the answer is exact. Without one (old v1 kernels) a SIGKILL
    death while the memory limit was hit is taken as an OOM kill.
    """
    if memory_dir is None:
        return False
    count = _counter(memory_dir / "memory.events", "oom_kill")
    if count is None:
        count = _counter(memory_dir / "memory.oom_control", "oom_kill")
    if count is not None:
        return count > 0
    failures = _plain_int(memory_dir / "memory.failcnt") or 0
    return killed_by_sigkill and failures > 0
