"""A CPU cgroup for usage ingest: background priority that holds across process groups.

``nice`` (and SCHED_IDLE) weigh a task only against the tasks of its own scheduling
group. With autogroups (one per session: the server's, ``pg_ctl``'s setsid) or systemd's
service cgroups, a niced ingest backend in PostgreSQL's group still takes half a CPU from
an API worker in the server's group, and the niced ingest worker half a CPU from a
create's backend (measured on one CPU: a spinner at nice 19 or SCHED_IDLE in another
session gets 50 %; in the same session 2 %; in a cgroup with ``cpu.idle`` = 1, 0 %).

So the ingest worker process (api/usage_worker.py), and with
``GPUCLOUD_USAGE_INGEST_BACKENDS=follow`` its local PostgreSQL backends, join a cgroup of
their own, ``gpucloud-usage-ingest-<pid>`` beside the worker's own cpu
cgroup, which is idle (``cpu.idle`` = 1; the least weight where the kernel has no
``cpu.idle``) while API calls run and of ordinary weight while the API is quiet: the
kernel then preempts ingest for any API work at once, whichever group that work is in.

It needs a writable cpu controller: root, and cgroup v1's cpu hierarchy or a v2 cgroup
whose children get the cpu controller (the root of the hierarchy, or one delegated so).
Elsewhere ``open_group`` returns None and ingest keeps to ``nice`` alone.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "gpucloud-usage-ingest-"
#: v1 ``cpu.shares`` and v2 ``cpu.weight``: (busy, quiet), where there is no cpu.idle.
_WEIGHTS = {1: ("2", "1024"), 2: ("1", "100")}
_REMOVE_SECONDS = 2.0


@dataclass(frozen=True)
class Hierarchy:
    """Where this process's cpu cgroup is on disk, and the cgroup version."""

    directory: Path
    version: int


def find_hierarchy(cgroups: str, mountinfo: str) -> Hierarchy | None:
    """The cpu cgroup of the process whose ``/proc/PID/cgroup`` and mountinfo these are
    (v1's cpu hierarchy first: on a hybrid host the v2 tree holds no cpu controller)."""
    paths: dict[int, str] = {}
    for line in cgroups.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            paths.setdefault(2, path)
        elif "cpu" in controllers.split(","):
            paths[1] = path
    mounts = _mounts(mountinfo)
    for version in (1, 2):
        if version in paths and version in mounts:
            root, point = mounts[version]
            inside = _relative(paths[version], root)
            if inside is not None:
                return Hierarchy(Path(point, inside), version)
    return None


def _mounts(mountinfo: str) -> dict[int, tuple[str, str]]:
    """Per version, the (root, mount point) of the cpu controller's mount."""
    found: dict[int, tuple[str, str]] = {}
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        parts, described = fields.split(), tail.split()
        if len(parts) < 5 or len(described) < 3:
            continue
        kind, options = described[0], described[2].split(",")
        if kind == "cgroup" and "cpu" in options:
            found.setdefault(1, (parts[3], parts[4]))
        elif kind == "cgroup2":
            found.setdefault(2, (parts[3], parts[4]))
    return found


def _relative(path: str, root: str) -> str | None:
    """``path`` (as /proc/PID/cgroup names it) below the mount's ``root``; None: the
    cgroup is outside what is mounted here."""
    if root == "/":
        return path.lstrip("/")
    if path == root or path.startswith(root.rstrip("/") + "/"):
        return path[len(root):].lstrip("/")
    return None


@dataclass
class IngestGroup:
    """The ingest cgroup: members join by pid (all of a process's threads), the group is
    idle while busy, and is removed when the worker ends."""

    path: Path
    parent: Path
    version: int

    def join(self, pid: int) -> bool:
        """Move process ``pid`` in (False: it is gone, or the kernel refused)."""
        try:
            (self.path / "cgroup.procs").write_text(str(pid))
        except ProcessLookupError:
            return False
        except OSError as error:
            log.warning("cannot move %d into %s (%s); it keeps to nice", pid, self.path,
                        error)
            return False
        return True

    def leave(self, thread_id: int) -> None:
        """Keep one thread of a member out (cgroup v1 only: v2 moves whole processes):
        the thread that makes the group idle and ordinary again must not wait on it."""
        if self.version == 1:
            try:
                (self.parent / "tasks").write_text(str(thread_id))
            except OSError as error:
                log.warning("cannot move thread %d out of %s (%s)", thread_id, self.path,
                            error)

    def set_busy(self, busy: bool) -> None:
        idle = self.path / "cpu.idle"
        try:
            if idle.exists():
                idle.write_text("1" if busy else "0")
            else:
                low, normal = _WEIGHTS[self.version]
                self._weight_file().write_text(low if busy else normal)
        except OSError as error:
            log.warning("cannot set %s busy=%s (%s)", self.path, busy, error)

    def _weight_file(self) -> Path:
        return self.path / ("cpu.shares" if self.version == 1 else "cpu.weight")

    def close(self, pid: int) -> None:
        """Move ``pid`` (the worker) back out and remove the group once its backends,
        whose connections the worker has closed, are gone too."""
        with contextlib.suppress(OSError):
            (self.parent / "cgroup.procs").write_text(str(pid))
        deadline = time.monotonic() + _REMOVE_SECONDS
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as error:
                if error.errno != errno.EBUSY or time.monotonic() > deadline:
                    log.warning("cannot remove %s (%s)", self.path, error)
                    return
                time.sleep(0.02)


def open_group(pid: int, proc: Path = Path("/proc")) -> IngestGroup | None:
    """Make the ingest cgroup of worker ``pid`` beside its own cpu cgroup (groups left by
    workers that died are removed first); None where that is not possible here."""
    try:
        hierarchy = find_hierarchy((proc / str(pid) / "cgroup").read_text(),
                                   (proc / str(pid) / "mountinfo").read_text())
    except OSError:
        hierarchy = None
    if hierarchy is None:
        log.info("no cpu cgroup found; usage ingest keeps to nice")
        return None
    _remove_stale(hierarchy.directory, proc)
    group = IngestGroup(hierarchy.directory / f"{PREFIX}{pid}", hierarchy.directory,
                        hierarchy.version)
    try:
        group.path.mkdir(exist_ok=True)
    except OSError as error:
        log.info("cannot make %s (%s); usage ingest keeps to nice", group.path, error)
        return None
    if not (group.path / "cpu.idle").exists() and not group._weight_file().exists():
        log.info("%s has no cpu controller; usage ingest keeps to nice", group.path)
        with contextlib.suppress(OSError):
            group.path.rmdir()
        return None
    return group


def _remove_stale(directory: Path, proc: Path) -> None:
    try:
        entries = list(directory.glob(f"{PREFIX}*"))
    except OSError:
        return
    for entry in entries:
        owner = entry.name.removeprefix(PREFIX)
        if owner.isdigit() and not (proc / owner).exists():
            with contextlib.suppress(OSError):
                entry.rmdir()
