"""The agent's side of ``gpucloud lazyfs``: start (supervise) the daemon, talk to it.

The daemon is started in a session of its own (``start_new_session``), so neither the
agent's exit nor a signal to the agent's process group reaches it: the mounts under the
pods' root filesystems outlive an agent restart, and the next agent simply reconnects to
the socket. If the daemon is gone (crashed, killed), the next request starts a new one,
which restores the mounts that still have holders (see ``daemon.py``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpucloud.images.auth import Credentials
from gpucloud.images.errors import ImageError

START_TIMEOUT = 15.0
LIBFUSE = "libfuse3.so.3"
"""Handed to the daemon as ``FUSE_LIBRARY_PATH``: mfusepy otherwise runs
``ctypes.util.find_library`` twice at import (``ldconfig`` and compiler probes, ~0.3 s of
the daemon's start)."""


def lazyfs_root(state_dir: Path) -> Path:
    """Where the daemon keeps its socket, mounts, cache and state. Defined here, not in
    ``daemon``, so the agent's import of this client does not load the FUSE stack."""
    return state_dir / "lazyfs"


class LazyfsError(ImageError):
    """The daemon refused a request; ``code`` is its error (e.g. ``RangeUnsupported``)."""

    reason = "LazyMountFailed"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class LazyfsClient:
    """Requests to the node's lazyfs daemon, starting it when it is not running."""

    def __init__(self, state_dir: Path, *, cache_limit: int | None = None,
                 read_deadline: float | None = None) -> None:
        self.state_dir = state_dir
        self.root = lazyfs_root(state_dir)
        self.socket = self.root / "control.sock"
        self._extra: list[str] = []
        if cache_limit is not None:
            self._extra += ["--cache-limit", str(cache_limit)]
        if read_deadline is not None:
            self._extra += ["--read-deadline", str(read_deadline)]
        self._lock = threading.Lock()

    def mount(self, *, digest: str, registry: str, repository: str, size: int,
              toc_digest: str, holder: str, insecure: bool = False,
              credentials: Credentials | None = None) -> Path:
        """Mount (or share) a layer for ``holder``; ``LazyfsError`` when it cannot be."""
        req: dict[str, Any] = {"op": "mount", "digest": digest, "registry": registry,
                               "repository": repository, "size": size,
                               "toc_digest": toc_digest, "holder": holder,
                               "insecure": insecure}
        if credentials is not None:
            req.update(username=credentials.username, password=credentials.password)
        return Path(self.request(req)["path"])

    def release(self, holder: str) -> None:
        """Drop ``holder`` from every layer. A daemon that is down is started first when
        its record (``layers.json``) still names the holder: else its next start would
        mount that layer again for a pod that is gone, and keep it mounted."""
        if self.running() or holder in self.holders():
            self.request({"op": "release", "holder": holder})

    def status(self) -> dict[str, Any]:
        return self.request({"op": "status"})

    def local(self, digest: str, toc_digest: str) -> tuple[int, int] | None:
        """(local, total) uncompressed bytes of a layer whose TOC the node has seen."""
        reply = self.request({"op": "local", "digest": digest, "toc_digest": toc_digest})
        return None if reply["local"] is None else (int(reply["local"]), int(reply["total"]))

    def events(self) -> list[dict[str, Any]]:
        """Queued events: {reason, message, holders} (holders: the bundles of the layer)."""
        return list(self.request({"op": "events"})["events"])

    def shutdown(self) -> None:
        """Stop the daemon (unmounting every layer) and wait until it is gone."""
        if not self.running():
            return
        try:
            self._send({"op": "shutdown"})
        except OSError:
            pass  # it may exit before its answer is read
        deadline = time.monotonic() + START_TIMEOUT
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.02)

    def holders(self) -> set[str]:
        """Every holder of a lazy mount by the daemon's own record (``layers.json``, kept
        across its restarts and the agent's), read without the daemon."""
        try:
            layers = json.loads((self.root / "layers.json").read_text())
        except (OSError, ValueError):
            return set()
        return {str(holder) for layer in layers if isinstance(layer, dict)
                for holder in layer.get("holders") or []}

    def pid(self) -> int:
        return int(self.request({"op": "ping"})["pid"])

    def running(self) -> bool:
        try:
            self._send({"op": "ping"})
        except OSError:
            return False
        return True

    def request(self, req: dict[str, Any]) -> dict[str, Any]:
        """Send one request (starting the daemon first if needed); raise on its error."""
        try:
            reply = self._send(req)
        except OSError:
            self.ensure_running()
            reply = self._send(req)
        if "error" in reply:
            raise LazyfsError(str(reply["error"]), str(reply["message"]))
        return reply

    def ensure_running(self) -> None:
        """Start the daemon unless one answers; wait until it does."""
        with self._lock:
            if self.running():
                return
            self.root.mkdir(parents=True, exist_ok=True)
            log = (self.root / "lazyfs.log").open("ab")
            process = subprocess.Popen(
                [sys.executable, "-m", "gpucloud.images.lazy.daemon",
                 "--state-dir", str(self.state_dir), *self._extra],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True,
                env={"FUSE_LIBRARY_PATH": LIBFUSE, **os.environ})
            log.close()
            deadline = time.monotonic() + START_TIMEOUT
            while time.monotonic() < deadline:
                if self.running():
                    return
                if process.poll() is not None:
                    raise LazyfsError("LazyfsFailed", "the lazyfs daemon exited at start: "
                                      + _tail(self.root / "lazyfs.log"))
                time.sleep(0.01)
            raise LazyfsError("LazyfsFailed", "the lazyfs daemon did not start in time")

    def _send(self, req: dict[str, Any]) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(120.0)
            sock.connect(str(self.socket))
            sock.sendall(json.dumps(req).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                part = sock.recv(1 << 16)
                if not part:
                    raise ConnectionError("lazyfs closed the connection")
                data += part
        reply: dict[str, Any] = json.loads(data)
        return reply


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-500:].strip()
    except FileNotFoundError:
        return ""
