"""Recording which files a container opens while it starts (``image optimize --record``).

The container runs with runc, from a bundle built exactly as the agent builds a pod's
(``runtime.bundle.build_bundle``: same mounts, capabilities, seccomp, own network namespace
with only loopback unless ``network``). Opens are observed with fanotify: ``FAN_OPEN`` marked
on the *file system* of the overlay rootfs (``FAN_MARK_FILESYSTEM``), because runc bind-mounts
the rootfs into the container's mount namespace and a per-mount mark would miss that mount.
Each event brings an fd of the opened file; ``/proc/self/fd/N`` names it as the container
sees it (after ``pivot_root`` the path is relative to the container's root; opens runc makes
before that carry the host path of the rootfs, which is stripped). Recording stops after
``period`` seconds, when a line of output matches ``wait_on_line``, or when the container
exits, whichever comes first. The result is every regular file opened, once, in order.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import shutil
import struct
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gpucloud.images.errors import ImageError
from gpucloud.runtime.bundle import ContainerSpec, ImageConfig, build_bundle
from gpucloud.runtime.layout import ContainerPaths

RUNC = "/usr/bin/runc"
_FAN_CLOEXEC = 0x1
_FAN_NONBLOCK = 0x2
_FAN_UNLIMITED_QUEUE = 0x10
_FAN_MARK_ADD = 0x1
_FAN_MARK_FILESYSTEM = 0x100
_FAN_OPEN = 0x20
_FAN_Q_OVERFLOW = 0x4000
_EVENT = struct.Struct("=IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int,
                                ctypes.c_char_p]
_AT_FDCWD = -100


class RecordError(ImageError):
    """The recording container could not be run or observed."""

    reason = "RecordFailed"


@dataclass(frozen=True)
class RecordOptions:
    """``command`` replaces the image's Cmd (empty: the image's own); ``period`` seconds."""

    command: tuple[str, ...] = ()
    period: float = 10.0
    wait_on_line: str | None = None
    network: bool = False


@dataclass(frozen=True)
class Recording:
    """Files opened, in order (absolute container paths), and what stopped the recording."""

    paths: tuple[str, ...]
    stopped_by: str
    output: str


class _Fanotify:
    """A fanotify group watching ``FAN_OPEN`` on one file system."""

    def __init__(self, target: Path) -> None:
        flags = _FAN_CLOEXEC | _FAN_NONBLOCK | _FAN_UNLIMITED_QUEUE
        self.fd = _libc.fanotify_init(flags, os.O_RDONLY | os.O_CLOEXEC)
        if self.fd < 0:
            raise RecordError(f"fanotify_init failed: {os.strerror(ctypes.get_errno())} "
                              "(recording needs root)")
        res = _libc.fanotify_mark(self.fd, _FAN_MARK_ADD | _FAN_MARK_FILESYSTEM, _FAN_OPEN,
                                  _AT_FDCWD, os.fsencode(target))
        if res != 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise RecordError(f"fanotify_mark on {target} failed: {os.strerror(err)}")

    def read(self) -> list[str]:
        """The paths of the events queued now (nothing if none)."""
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        paths: list[str] = []
        pos = 0
        while pos + _EVENT.size <= len(data):
            length, _, _, _, mask, fd, _ = _EVENT.unpack_from(data, pos)
            pos += max(length, _EVENT.size)
            if mask & _FAN_Q_OVERFLOW or fd < 0:
                continue
            try:
                paths.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
            finally:
                os.close(fd)
        return paths

    def close(self) -> None:
        os.close(self.fd)


def record(rootfs: Path, image_config: dict[str, Any], options: RecordOptions,
           workdir: Path) -> Recording:
    """Run the image's start in a container on ``rootfs`` and record the files it opens."""
    cid = "optimize-" + uuid.uuid4().hex[:12]
    paths = ContainerPaths(workdir / "bundles" / cid)
    spec = ContainerSpec(container_id=cid, hostname="optimize",
                         command=list(options.command) or None, host_network=options.network)
    build_bundle(paths, rootfs, ImageConfig.from_dict(image_config), spec,
                 cgroup_path=f"/gpucloud-optimize/{cid}")
    pattern = re.compile(options.wait_on_line) if options.wait_on_line else None
    watcher = _Fanotify(rootfs)
    runc_root = workdir / "runc"
    try:
        proc = subprocess.Popen(
            [RUNC, "--root", str(runc_root), "run", "--bundle", str(paths.root), cid],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            opened, stopped_by, output = _watch(proc, watcher, pattern, options.period)
        finally:
            _stop(proc, runc_root, cid)
        opened += watcher.read()
    finally:
        watcher.close()
        shutil.rmtree(paths.root, ignore_errors=True)
    return Recording(_container_paths(opened, rootfs), stopped_by, output)


def _watch(proc: subprocess.Popen[bytes], watcher: _Fanotify, pattern: re.Pattern[str] | None,
           period: float) -> tuple[list[str], str, str]:
    """Collect events until the period ends, the line appears or the container exits."""
    assert proc.stdout is not None
    out: IO[bytes] = proc.stdout
    deadline = time.monotonic() + period
    opened: list[str] = []
    buffer = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return opened, "period", buffer.decode(errors="replace")
        ready, _, _ = select.select([watcher.fd, out], [], [], left)
        if watcher.fd in ready:
            opened += watcher.read()
        if out not in ready:
            continue
        chunk = os.read(out.fileno(), 1 << 16)
        if not chunk:
            proc.wait()
            return opened, "exit", buffer.decode(errors="replace")
        buffer += chunk
        if pattern is not None and _matches(pattern, buffer):
            return opened, "line", buffer.decode(errors="replace")


def _matches(pattern: re.Pattern[str], buffer: bytes) -> bool:
    return any(pattern.search(line) for line in buffer.decode(errors="replace").splitlines())


def _stop(proc: subprocess.Popen[bytes], runc_root: Path, cid: str) -> None:
    if proc.poll() is None:
        subprocess.run([RUNC, "--root", str(runc_root), "kill", cid, "KILL"],
                       capture_output=True, check=False)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    subprocess.run([RUNC, "--root", str(runc_root), "delete", "--force", cid],
                   capture_output=True, check=False)
    if proc.stdout is not None:
        proc.stdout.close()
    root = Path("/sys/fs/cgroup")
    for parent in [*root.glob("gpucloud-optimize"), *root.glob("*/gpucloud-optimize")]:
        try:
            parent.rmdir()
        except OSError:
            pass


def _container_paths(opened: list[str], rootfs: Path) -> tuple[str, ...]:
    """Absolute in-container paths, host rootfs prefix stripped, first open only."""
    prefix = str(rootfs.resolve())
    seen: dict[str, None] = {}
    for path in opened:
        if path.endswith(" (deleted)"):
            continue
        if path == prefix or path.startswith(prefix + "/"):
            path = path[len(prefix):] or "/"
        seen.setdefault(path, None)
    return tuple(seen)
