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

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from gpucloud.agent.connection import Connection
from gpucloud.core.models import AgentLogChunkRequest
from gpucloud.core.trace import mark
from gpucloud.runtime.logs import read_from

log = logging.getLogger(__name__)
CHUNK_BYTES = 256 * 1024


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
