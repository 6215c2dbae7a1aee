"""Pieces of an OCI runtime config (runtime spec 1.0.2) that do not depend on the pod.

Defaults follow Docker's: its capability set, its default seccomp profile (seccomp.py),
``noNewPrivileges``, masked and read-only /proc paths, and the standard /proc, /dev,
/dev/pts, /dev/shm, /dev/mqueue and /sys mounts. Nothing a user sends reaches these: no
privileged flag, no extra capability, no device, no host path (the only binds are the
agent's own files and the pod's volume disks, whose container paths ``check_mount_path``
keeps off /proc, /sys, /dev and /).
"""

from __future__ import annotations

import json
import resource
from functools import cache
from pathlib import Path
from typing import Any

from gpucloud.runtime import seccomp

OCI_VERSION = "1.0.2"
CPU_PERIOD_US = 100_000
MIN_CPU_QUOTA_US = 1_000
UNLIMITED = 2**64 - 1

DEFAULT_CAPABILITIES: tuple[str, ...] = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
)

MASKED_PATHS: tuple[str, ...] = (
    "/proc/asound", "/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
    "/sys/firmware", "/sys/devices/virtual/powercap",
)

READONLY_PATHS: tuple[str, ...] = (
    "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
)


#: /proc/self/status ``CapEff`` of a root process in a ``docker run`` container.
DOCKER_DEFAULT_CAP_MASK = 0x00000000A80425FB


def capabilities() -> dict[str, list[str]]:
    """Docker's set as bounding, effective and permitted; none inheritable or ambient (so
    a non-root user gets none, and exec'ed programs no more than the set)."""
    caps = list(DEFAULT_CAPABILITIES)
    return {"bounding": caps, "effective": list(caps), "permitted": list(caps),
            "inheritable": [], "ambient": []}


def seccomp_profile() -> dict[str, Any]:
    """Docker's default seccomp profile resolved for the capabilities pods get: a fresh
    copy of it (the caller may change it), resolved once per process (milliseconds of
    every pod's start otherwise; the host's architecture and kernel do not change)."""
    loaded: dict[str, Any] = json.loads(seccomp_text())
    return loaded


@cache
def seccomp_text() -> str:
    """``seccomp_profile`` as JSON text, built once per process: a bundle's
    ``config.json`` takes it as it is (bundle.py), not decoded and encoded again."""
    return json.dumps(seccomp.profile(DEFAULT_CAPABILITIES))


@cache
def shared_seccomp_profile() -> dict[str, Any]:
    """``seccomp_profile`` decoded once per process and shared by every bundle's
    ``Bundle.config``: read it, never change it (``seccomp_profile`` is the copy to
    change)."""
    loaded: dict[str, Any] = json.loads(seccomp_text())
    return loaded


def standard_mounts(shm_size_bytes: int) -> list[dict[str, Any]]:
    """The kernel filesystems every container gets."""
    return [
        {"destination": "/proc", "type": "proc", "source": "proc",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={shm_size_bytes}"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
         "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
    ]


def bind_mount(source: Path, destination: str, *, readonly: bool) -> dict[str, Any]:
    options = ["rbind", "nosuid", "nodev", "ro" if readonly else "rw"]
    return {"destination": destination, "type": "bind", "source": str(source), "options": options}


def _hard_limit(kind: int) -> int:
    """Our own hard limit (inherited by runc); raising past it needs CAP_SYS_RESOURCE,
    which the agent may not have, so containers get at most this."""
    hard = resource.getrlimit(kind)[1]
    return UNLIMITED if hard == resource.RLIM_INFINITY else hard


def nofile_limit(nr_open: Path = Path("/proc/sys/fs/nr_open")) -> int:
    """RLIMIT_NOFILE for containers: 1Mi, or the kernel's or our own ceiling if lower."""
    return min(1_048_576, _kernel_nofile_ceiling(nr_open), _hard_limit(resource.RLIMIT_NOFILE))


@cache
def _kernel_nofile_ceiling(nr_open: Path) -> int:
    """``fs.nr_open``, read once per process (it was a read of /proc on every pod's
    start; only the host's administrator changes it, and a container gets at most the
    agent's own hard limit anyway)."""
    try:
        return int(nr_open.read_text().strip())
    except (OSError, ValueError):
        return 65_536


def rlimits() -> list[dict[str, Any]]:
    """Generous file limits; as much locked memory as allowed (unlimited when the agent
    has it), which NCCL and RDMA need for pinned buffers. Locked pages still count
    against the memory limit."""
    files = nofile_limit()
    memlock = _hard_limit(resource.RLIMIT_MEMLOCK)
    return [
        {"type": "RLIMIT_NOFILE", "soft": files, "hard": files},
        {"type": "RLIMIT_MEMLOCK", "soft": memlock, "hard": memlock},
    ]


def cpu_resources(cpu_milli: int) -> dict[str, int]:
    """CFS shares (relative weight) and quota (hard cap) for ``cpu_milli`` milli-cores."""
    if cpu_milli <= 0:
        return {}
    quota = max(MIN_CPU_QUOTA_US, cpu_milli * CPU_PERIOD_US // 1000)
    return {"shares": max(2, cpu_milli * 1024 // 1000), "quota": quota, "period": CPU_PERIOD_US}


def memory_resources(memory_bytes: int) -> dict[str, int]:
    """A memory limit with swap equal to it (memory+swap in cgroup v1), so that the limit
    holds on hosts with swap instead of spilling over."""
    if memory_bytes <= 0:
        return {}
    return {"limit": memory_bytes, "swap": memory_bytes}
