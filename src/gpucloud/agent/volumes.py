"""Pods' disks on this node: volume disks, network volume mounts, and their size limits.

A pod's volume disk is ``<state-dir>/volumes/<pod id>``, bind-mounted at its volume path.
It outlives the pod's containers (stop, start, agent restarts) and goes only when the
server's assignments no longer list the pod among the node's ``volume_pods`` (the pod was
deleted, or its volume moved): see ``VolumeStore.collect``.

Sizes: where the file system holding the state directory is mounted with project quotas
(ext4 ``prjquota``, xfs ``pquota``/``prjquota``) and ``setquota`` (ext4) or ``xfs_quota``
is installed, the volume directory gets a project quota and writes past the size fail
with EDQUOT. Everywhere else — and as a second line behind the quota — the limit is
checked: the pod worker measures the disks every ``disk_check_interval`` seconds and
stops a pod over its size, reason ``VolumeFull`` or ``ContainerDiskFull`` (the volume is
kept; the container disk, as on every stop, is wiped). docs/volumes.md says which.

Network volumes come from the server's machine: ``hostpath`` binds the server's directory
(all agents on that machine), ``nfs`` mounts ``<server host>:<dir>`` once per volume
under ``<state-dir>/netvols/<volume id>`` and binds that.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from ipaddress import ip_address
from pathlib import Path
from urllib.parse import urlsplit

from gpucloud.core.access import DEFAULT_VOLUME_PATH, NetworkVolumeMount
from gpucloud.core.models import AssignmentOut
from gpucloud.core.quantities import format_memory
from gpucloud.runtime.bundle import BindMount
from gpucloud.runtime.errors import RuntimeFailure

log = logging.getLogger(__name__)
HOSTPATH, NFS = "hostpath", "nfs"
_QUOTA_OPTIONS = {"prjquota", "pquota", "prjjquota"}


def default_volume_mode(server_url: str) -> str:
    """``hostpath`` when the server is on this machine (a loopback URL), else ``nfs``."""
    host = urlsplit(server_url).hostname or ""
    if host == "localhost":
        return HOSTPATH
    try:
        return HOSTPATH if ip_address(host).is_loopback else NFS
    except ValueError:
        return NFS


def disk_usage(root: Path) -> int:
    """Bytes allocated under ``root`` (like ``du -s``): blocks of every file and directory,
    hard links once, not following symlinks nor crossing into other file systems."""
    try:
        device = root.lstat().st_dev
    except FileNotFoundError:
        return 0
    seen: set[int] = set()
    total = 0
    stack = [root]
    while stack:
        for entry in _entries(stack.pop()):
            info = entry.stat(follow_symlinks=False)
            if info.st_dev != device or (info.st_nlink > 1 and info.st_ino in seen):
                continue
            seen.add(info.st_ino)
            total += info.st_blocks * 512
            if stat.S_ISDIR(info.st_mode):
                stack.append(Path(entry.path))
    return total


def _entries(directory: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


@dataclass(frozen=True)
class DiskLimit:
    """One disk of a pod and its size: ``what`` names it in the pod's reason."""

    reason: str
    what: str
    path: Path
    limit_bytes: int

    def excess(self) -> str | None:
        """None while within the limit, else the message the pod is stopped with."""
        used = disk_usage(self.path)
        if used <= self.limit_bytes:
            return None
        return (f"{self.what} uses {format_memory(used)} of {format_memory(self.limit_bytes)};"
                " the pod was stopped")


def _mount_entry(path: Path) -> tuple[str, set[str]] | None:
    """The mount point and options of the file system holding ``path``."""
    best: tuple[str, set[str]] | None = None
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    resolved = str(path.resolve())
    for line in lines:
        fields = line.split(" - ")
        head, tail = fields[0].split(), fields[-1].split()
        point = head[4]
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, set(head[5].split(",")) | set(tail[-1].split(",")))
    return best


def project_quota_tool(path: Path) -> tuple[str, str] | None:
    """``(tool, mount point)`` when project quotas can limit directories under ``path``:
    the file system is mounted with them and the tool to set them is installed."""
    entry = _mount_entry(path)
    if entry is None or not entry[1] & _QUOTA_OPTIONS:
        return None
    for tool in ("setquota", "xfs_quota"):
        if shutil.which(tool):
            return tool, entry[0]
    return None


class VolumeStore:
    """The node's volume disks and network volume mounts."""

    def __init__(self, state_dir: Path, server_url: str, mode: str) -> None:
        self.root = state_dir / "volumes"
        self.netvols = state_dir / "netvols"
        self.server_host = urlsplit(server_url).hostname or "localhost"
        self.mode = mode
        self.quota = project_quota_tool(state_dir)

    def disk(self, pod_id: str) -> Path:
        return self.root / pod_id

    def binds(self, assignment: AssignmentOut) -> tuple[BindMount, ...]:
        """The pod's volume disk (made on first use) and network volumes, to bind in."""
        binds = []
        if assignment.volume_bytes is not None:
            disk = self._ensure_disk(assignment.pod_id, assignment.volume_bytes)
            binds.append(BindMount(disk, assignment.volume_path or DEFAULT_VOLUME_PATH))
        for mount in assignment.network_volumes:
            binds.append(BindMount(self._network_source(mount), mount.path))
        return tuple(binds)

    def _ensure_disk(self, pod_id: str, size: int) -> Path:
        disk = self.disk(pod_id)
        if not disk.is_dir():
            disk.mkdir(parents=True)
            if self.quota is not None:
                self._set_quota(disk, pod_id, size)
        return disk

    def _set_quota(self, disk: Path, pod_id: str, size: int) -> None:
        """A project quota on the new directory (id from the pod id); failures are logged
        and leave the checked limit alone in charge."""
        assert self.quota is not None
        tool, point = self.quota
        project = int(pod_id[:7], 16) + 1
        kib = max(1, size // 1024)
        commands = [["chattr", "+P", "-p", str(project), str(disk)]]
        commands.append(["setquota", "-P", str(project), "0", str(kib), "0", "0", point]
                        if tool == "setquota" else
                        ["xfs_quota", "-x", "-c", f"limit -p bhard={kib}k {project}", point])
        for command in commands:
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                log.warning("project quota for %s: %s: %s", disk, command[0],
                            done.stderr.strip())
                return

    def _network_source(self, mount: NetworkVolumeMount) -> Path:
        """Where the network volume is on this machine: the server's directory itself
        (hostpath) or an NFS mount of it (made once, kept for later pods)."""
        if mount.mode == HOSTPATH:
            source = Path(mount.source)
            if not source.is_dir():
                raise RuntimeFailure(
                    f"network volume {mount.name}: {source} is not a directory on this node "
                    "(hostpath mode needs the agent on the server's machine; use "
                    "--volume-mode nfs)")
            return source
        target = self.netvols / mount.volume_id
        if not os.path.ismount(target):
            target.mkdir(parents=True, exist_ok=True)
            remote = f"{self.server_host}:{mount.source}"
            done = subprocess.run(["mount", "-t", "nfs", remote, str(target)],
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeFailure(f"network volume {mount.name}: mounting {remote} over NFS "
                                     f"failed: {done.stderr.strip() or done.returncode}")
        return target

    def limits(self, assignment: AssignmentOut, writable_layer: Path) -> list[DiskLimit]:
        """The pod's disks with a size to hold them to."""
        limits = []
        if assignment.volume_bytes is not None:
            path = assignment.volume_path or DEFAULT_VOLUME_PATH
            limits.append(DiskLimit("VolumeFull", f"volume {path}",
                                    self.disk(assignment.pod_id), assignment.volume_bytes))
        if assignment.container_disk_bytes is not None:
            limits.append(DiskLimit("ContainerDiskFull", "container disk", writable_layer,
                                    assignment.container_disk_bytes))
        return limits

    def collect(self, keep: Collection[str], busy: Iterable[str]) -> list[str]:
        """Delete the volume disks of pods not in ``keep`` (the server's complete list of
        this node's volume pods) and not run by a live worker (``busy``); returns the ids."""
        if not self.root.is_dir():
            return []
        spare = set(keep) | set(busy)
        removed = []
        for path in sorted(self.root.iterdir()):
            if path.is_dir() and path.name not in spare:
                log.info("deleting the volume disk of pod %s: no longer on this node", path.name)
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
        return removed
