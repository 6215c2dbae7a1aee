"""Shipping a container's log to the server, incrementally, by byte offset.

The server stores text and counts offsets in UTF-8 bytes of what it stored; the file holds
whatever the container wrote. The two offsets match for valid UTF-8 and drift apart where
invalid bytes are replaced, so both are tracked, and saved after every accepted chunk
(``<state-dir>/logship/<container>.json``) so that a restarted agent resumes exactly where
the server's copy ends.

The record is a hint, not the truth: the server answers every chunk with its end and the
shipper realigns on a difference. So a record that cannot be saved (a full state dir) is
logged and shipping goes on; a restarted agent then resends from the older record and the
server, which stores each offset once, answers where its copy really ends.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import select
import threading
from dataclasses import dataclass
from pathlib import Path

from gpucloud.agent.connection import Connection
from gpucloud.core.models import AgentLogChunkRequest
from gpucloud.core.trace import mark
from gpucloud.runtime.logs import read_from

log = logging.getLogger(__name__)
CHUNK_BYTES = 256 * 1024
_IN_MODIFY = 0x00000002
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_libc = ctypes.CDLL(None, use_errno=True)


def _sequence_length(lead: int) -> int:
    """How many bytes the UTF-8 sequence starting with ``lead`` has (1 when invalid)."""
    for length, prefix, bits in ((2, 0b110, 3), (3, 0b1110, 4), (4, 0b11110, 5)):
        if lead >> (8 - bits) == prefix:
            return length
    return 1


def complete_utf8_prefix(data: bytes) -> int:
    """The length of ``data`` without a multi-byte UTF-8 sequence cut off at its end."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: does its sequence fit?
            return len(data) if back >= _sequence_length(byte) else len(data) - back
    return len(data)


@dataclass
class Offsets:
    file: int = 0
    server: int = 0


class LogShipper:
    def __init__(self, conn: Connection, pod_id: str, log_path: Path, record: Path,
                 attempt: int | None = None) -> None:
        self.conn = conn
        self.pod_id = pod_id
        self.attempt = attempt
        self.log_path = log_path
        self.record = record
        self.offsets: Offsets | None = None
        self._save_failing = False

    def ship(self, final: bool = False) -> bool:
        """Send what the file has beyond the server's copy; False when the server refused.

        ``final``: the container has ended, so a trailing partial character is sent too.
        """
        if self.offsets is None:
            # Where the server's copy ended when last acknowledged (zero for a new
            # container). No round trip to ask: the server answers every chunk with its
            # end, and ``_send`` realigns on a difference (a restart's lost ack).
            self.offsets = self._load()
        while True:
            chunk = read_from(self.log_path, self.offsets.file, CHUNK_BYTES)
            used = len(chunk.data) if final else complete_utf8_prefix(chunk.data)
            if used == 0:
                return True
            mark("agent.log.read", bytes=used, at=self.offsets.file)
            if not self._send(chunk.data[:used].decode(errors="replace"), used):
                return False
            mark("agent.log.shipped", bytes=used)

    def forget(self) -> None:
        self.record.unlink(missing_ok=True)

    def shipped_any(self) -> bool:
        """Whether some of the log reached the server (by this shipper or an earlier one)."""
        return self.offsets is not None and self.offsets.file > 0

    def behind(self) -> bool:
        """Whether the file holds bytes not shipped yet: one ``stat``, nothing read."""
        try:
            size = self.log_path.stat().st_size
        except OSError:
            return False
        return size > (self.offsets.file if self.offsets is not None else 0)

    def _send(self, text: str, raw_bytes: int) -> bool:
        assert self.offsets is not None
        expected = self.offsets.server + len(text.encode())
        end = self._post(self.offsets.server, text)
        if end is None:
            return False
        if end == expected:
            self.offsets = Offsets(self.offsets.file + raw_bytes, end)
            self._save()
        else:
            self._align(end)
        return True

    def _align(self, server_end: int) -> None:
        """Move the file offset by as much as the server's end differs from ours (it got a
        chunk whose acknowledgement we lost, e.g. across a restart)."""
        assert self.offsets is not None
        delta = server_end - self.offsets.server
        self.offsets = Offsets(max(0, self.offsets.file + delta), server_end)
        self._save()

    def _post(self, offset: int, text: str) -> int | None:
        return self.conn.write(
            f"log of pod {self.pod_id}",
            lambda client, token: client.append_log(
                self.pod_id, AgentLogChunkRequest(fencing_token=token, attempt=self.attempt,
                                                  offset=offset, data=text)
            ),
        )

    def _load(self) -> Offsets:
        try:
            data = json.loads(self.record.read_text())
            return Offsets(int(data["file"]), int(data["server"]))
        except (OSError, ValueError, KeyError, TypeError):
            return Offsets()

    def _save(self) -> None:
        assert self.offsets is not None
        tmp = self.record.with_name(f".{self.record.name}.tmp")
        try:
            self.record.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"file": self.offsets.file,
                                       "server": self.offsets.server}))
            os.replace(tmp, self.record)
        except OSError as error:
            tmp.unlink(missing_ok=True)
            if not self._save_failing:  # once per outage, not once per chunk
                log.warning("log of pod %s: cannot save the shipped offset in %s (%s); "
                            "shipping goes on", self.pod_id, self.record.parent, error)
            self._save_failing = True
            return
        if self._save_failing:
            log.info("log of pod %s: the shipped offset is saved again", self.pod_id)
        self._save_failing = False


class LogWatch:
    """Wakes a waiter the moment a log file is written to, or when another thread asks.

    inotify (``IN_MODIFY`` on the file: one event per write the container makes) and an
    eventfd, polled together: ``wait`` returns as soon as the container's first bytes land
    in the file, without a periodic ``stat``. ``open`` gives None where inotify is not
    available (no such file yet, the per-user limit of inotify instances reached): the
    caller then looks with ``LogShipper.behind`` instead.
    """

    def __init__(self, inotify_fd: int, event_fd: int) -> None:
        self._inotify = inotify_fd
        self._event = event_fd
        self._lock = threading.Lock()  # interrupt (any thread) against close
        self._closed = False
        self._poller = select.poll()
        self._poller.register(inotify_fd, select.POLLIN)
        self._poller.register(event_fd, select.POLLIN)

    @classmethod
    def open(cls, path: Path) -> LogWatch | None:
        fd = _libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            log.debug("inotify unavailable: %s", os.strerror(ctypes.get_errno()))
            return None
        if _libc.inotify_add_watch(fd, os.fsencode(path), _IN_MODIFY) < 0:
            os.close(fd)
            return None
        try:
            event = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except OSError:
            os.close(fd)
            return None
        return cls(fd, event)

    def wait(self, timeout: float) -> bool:
        """Until the file is written to or ``interrupt`` is called (True), at most
        ``timeout`` seconds (False; 0: only whether that happened already). Writes made
        before the watch was opened do not count: look at the file's size after ``open``,
        before waiting."""
        try:
            ready = self._poller.poll(max(0.0, timeout) * 1000)
        except InterruptedError:
            return False
        for fd, _events in ready:
            self._drain(fd)
        return bool(ready)

    def interrupt(self) -> None:
        """End a ``wait`` now, or the next one at once (from any thread)."""
        with self._lock:
            if not self._closed:
                try:
                    os.eventfd_write(self._event, 1)
                except BlockingIOError:
                    pass  # the counter is full: a wake-up is pending anyway

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._inotify)
            os.close(self._event)

    @staticmethod
    def _drain(fd: int) -> None:
        try:
            while os.read(fd, 4096):
                pass
        except OSError as error:
            if error.errno != errno.EAGAIN:
                raise
