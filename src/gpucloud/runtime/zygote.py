"""The driver's end of the supervisor zygote (``supervisor.serve``).

Starting a supervisor as ``python -m gpucloud.runtime.supervisor`` costs an interpreter
start and its imports (40–50 ms here, more under load), paid by every pod start. The
zygote is one such interpreter, started once per driver and kept: a start is a datagram to
it, handed to the spare supervisor it forked ahead while idle (else forked for then; see
``supervisor.serve``). Once the start's status line is in (``runc`` has started the
container, or failed), a datagram without a descriptor (``START_OVER``) tells the zygote
that this start no longer needs the CPU: it makes its next spare only when no start is
under way. What runs is the same supervisor code with the same detachment
(setsid, not the agent's child), so a container started either way looks the same to the
driver, to ``status`` and to a restarted agent.

The zygote is the driver's child and ends when the driver's socket closes (the agent
exits), and its unused spare with it; supervisors it started are not its children and
keep running. When it cannot be
reached (it died), the request goes to a new one, once.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import threading
import time
from collections.abc import Sequence

READ_BYTES = 4096
#: The driver's word that a start it asked for is over (no descriptor attached).
START_OVER = b"[]"


class ZygoteUnavailable(Exception):
    """The zygote could not be started or reached (the caller execs the supervisor)."""


class Zygote:
    def __init__(self, python: str) -> None:
        self.python = python
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def start_supervisor(self, argv: Sequence[str], timeout: float) -> str:
        """Have a supervisor started with ``argv`` (what ``supervisor.main`` takes) and
        return its status line ("" when it ended without one).

        Raises ZygoteUnavailable when no zygote takes the request, TimeoutError when the
        line does not come within ``timeout`` seconds.
        """
        read_end, write_end = os.pipe()
        try:
            try:
                self._send(json.dumps(list(argv)).encode(), write_end)
            finally:
                os.close(write_end)  # the supervisor holds the only other copy now
            return _read_line(read_end, timeout)
        finally:
            os.close(read_end)
            self._start_over()

    def _start_over(self) -> None:
        """Tell the zygote that a start it took is over (its next spare may be made). A
        zygote gone meanwhile is left to the next start; one that never hears this stops
        counting the start after ``supervisor.START_SECONDS``."""
        with self._lock:
            if self._sock is None:
                return
            try:
                self._sock.send(START_OVER, socket.MSG_DONTWAIT)
            except OSError:
                pass

    def prestart(self) -> None:
        """Start the zygote now, in the background, so that the first container start (a
        cold node's first pod) does not wait for its interpreter and imports. A start
        asked meanwhile waits for it (the lock); a failure here is left to that start."""
        def spawn() -> None:
            with self._lock:
                if self._sock is None:
                    try:
                        self._spawn()
                    except ZygoteUnavailable:
                        pass

        threading.Thread(target=spawn, name="zygote-prestart", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _send(self, message: bytes, fd: int) -> None:
        with self._lock:
            for attempt in range(2):
                if self._sock is None or (self._process and self._process.poll() is not None):
                    self._stop()
                    self._spawn()
                assert self._sock is not None
                try:
                    socket.send_fds(self._sock, [message], [fd])
                    return
                except OSError as error:  # it died: once more with a new one
                    self._stop()
                    if attempt:
                        raise ZygoteUnavailable(f"supervisor zygote: {error}") from None

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # cwd "/": ``python -m`` puts the working directory first on sys.path.
            self._process = subprocess.Popen(
                [self.python, "-m", "gpucloud.runtime.supervisor", "--zygote",
                 str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, cwd="/")
        except OSError as error:
            ours.close()
            raise ZygoteUnavailable(f"cannot start the supervisor zygote: {error}") from None
        finally:
            theirs.close()
        self._sock = ours

    def _stop(self) -> None:
        if self._sock is not None:
            self._sock.close()  # the zygote sees EOF and exits
            self._sock = None
        if self._process is not None:
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None


def _read_line(fd: int, timeout: float) -> str:
    """Everything written to ``fd`` until its writers close it (one status line)."""
    deadline = time.monotonic() + timeout
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise TimeoutError
        chunk = os.read(fd, READ_BYTES)
        if not chunk:
            return data.decode(errors="replace").strip()
        data += chunk
