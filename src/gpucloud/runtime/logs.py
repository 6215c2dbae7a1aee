"""Reading a container's log file: the last N lines, or new bytes from an offset.

Offsets are byte positions in the file, so a follower resumes exactly where it stopped,
across agent restarts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

_BLOCK = 64 * 1024


@dataclass(frozen=True)
class LogChunk:
    data: bytes
    offset: int
    next_offset: int

    @property
    def text(self) -> str:
        return self.data.decode(errors="replace")


def tail(path: Path, lines: int) -> bytes:
    """The last ``lines`` lines of the file (all of it when shorter); b"" if it is missing.

    Reads backwards in blocks, so a large log costs only what is returned.
    """
    if lines <= 0:
        return b""
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        return b""
    with handle:
        end = handle.seek(0, os.SEEK_END)
        position, data = end, b""
        # A trailing newline ends the last line; it does not start a new one.
        while position > 0 and data.count(b"\n", 0, len(data) - 1 if data else 0) < lines:
            step = min(_BLOCK, position)
            position -= step
            handle.seek(position)
            data = handle.read(step) + data
    body = data[:-1] if data.endswith(b"\n") else data
    kept = body.split(b"\n")[-lines:]
    return b"\n".join(kept) + (b"\n" if data.endswith(b"\n") else b"")


def read_from(path: Path, offset: int, limit: int = 1024 * 1024) -> LogChunk:
    """Up to ``limit`` bytes from ``offset``; an empty chunk when nothing new is there."""
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            data = handle.read(limit)
    except FileNotFoundError:
        data = b""
    return LogChunk(data, offset, offset + len(data))


def follow(
    path: Path,
    offset: int = 0,
    *,
    done: Callable[[], bool],
    poll_seconds: float = 0.2,
    limit: int = 1024 * 1024,
) -> Iterator[LogChunk]:
    """Chunks as they are written, until ``done()`` is true and the file is drained."""
    while True:
        finished = done()
        chunk = read_from(path, offset, limit)
        if chunk.data:
            offset = chunk.next_offset
            yield chunk
            continue
        if finished:
            return
        time.sleep(poll_seconds)
