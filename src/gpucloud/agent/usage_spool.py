"""Usage samples kept on the node until the server acknowledges them.

Per container ``<spool>/<cid>.jsonl`` holds its unacknowledged samples, one JSON line
each, appended and fsynced before they are sent; ``<spool>/<cid>.state`` holds the next
sequence number and the highest acknowledged one. A sample is taken, written, then sent,
all on one thread, so after a crash (SIGKILL, power loss) the spool holds every sample
the server may not have: a torn last line was never sent and is dropped, lines at or
below the acknowledged sequence are dropped on load (the crash came between saving the
state and rewriting the file), and everything else is sent again — the server stores a
(pod, attempt, seq) once, so a resend never counts twice.

A full disk (ENOSPC) is an error the caller logs, never a corrupt spool: a failed append
is cut off again (truncating needs no space), so the file keeps whole lines and the
sample is simply not taken (the next one carries the cumulative counters); a failed
rewrite or state save leaves the previous file in place (replaced only once complete) and
no temporary file behind. When space returns, the next round carries on.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from gpucloud.core.usage import UsageSample

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    next_seq: int = 0
    acked: int = -1
    pending: list[UsageSample] = field(default_factory=list)


class UsageSpool:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._streams: dict[str, _Stream] = {}
        for path in sorted(directory.glob("*.state")) + sorted(directory.glob("*.jsonl")):
            self._stream(path.stem)

    # -- writing -------------------------------------------------------------------------

    def append(self, cid: str, make: Callable[[int], UsageSample]) -> UsageSample:
        """Take the next sequence number, build the sample with it, and make it durable."""
        stream = self._stream(cid)
        sample = make(stream.next_seq)
        fd = os.open(self._lines(cid), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            whole = os.lseek(fd, 0, os.SEEK_END)
            try:
                _write_all(fd, (sample.model_dump_json() + "\n").encode())
                os.fsync(fd)
            except OSError:
                os.ftruncate(fd, whole)  # no torn line for the next append to glue onto
                raise
        finally:
            os.close(fd)
        stream.next_seq = sample.seq + 1
        stream.pending.append(sample)
        return sample

    def acknowledge(self, cid: str, up_to: int) -> None:
        """The server has (or refused for good) every sample of ``cid`` up to ``up_to``."""
        stream = self._streams.get(cid)
        if stream is None or up_to <= stream.acked:
            return
        stream.acked = up_to
        stream.pending = [s for s in stream.pending if s.seq > up_to]
        self._save_state(cid, stream)
        if stream.pending:
            self._rewrite(cid, stream.pending)
        else:
            self._lines(cid).unlink(missing_ok=True)

    def forget(self, cid: str) -> None:
        """A container that is gone and fully acknowledged: its files go."""
        self._streams.pop(cid, None)
        self._lines(cid).unlink(missing_ok=True)
        self._state(cid).unlink(missing_ok=True)

    # -- reading -------------------------------------------------------------------------

    def pending(self, limit: int) -> list[UsageSample]:
        """Up to ``limit`` unacknowledged samples, oldest first per container."""
        out: list[UsageSample] = []
        for cid in sorted(self._streams):
            out.extend(self._streams[cid].pending[: max(0, limit - len(out))])
            if len(out) >= limit:
                break
        return out

    def pending_of(self, cid: str) -> list[UsageSample]:
        stream = self._streams.get(cid)
        return list(stream.pending) if stream else []

    def containers(self) -> list[str]:
        return sorted(self._streams)

    # -- files ---------------------------------------------------------------------------

    def _lines(self, cid: str) -> Path:
        return self.directory / f"{cid}.jsonl"

    def _state(self, cid: str) -> Path:
        return self.directory / f"{cid}.state"

    def _stream(self, cid: str) -> _Stream:
        if cid not in self._streams:
            self._streams[cid] = self._load(cid)
        return self._streams[cid]

    def _load(self, cid: str) -> _Stream:
        stream = _Stream()
        try:
            state = json.loads(self._state(cid).read_text())
            stream.next_seq, stream.acked = int(state["next_seq"]), int(state["acked"])
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("usage spool %s: unreadable state (%s); resending all it holds", cid,
                        error)
        samples, whole = self._read_lines(cid)
        stream.pending = [s for s in samples if s.seq > stream.acked]
        if samples:
            stream.next_seq = max(stream.next_seq, samples[-1].seq + 1)
        if whole is not None:
            try:
                self._rewrite(cid, stream.pending)
            except OSError:  # a full disk: cutting the torn tail off needs no space
                os.truncate(self._lines(cid), whole)
        return stream

    def _read_lines(self, cid: str) -> tuple[list[UsageSample], int | None]:
        """The whole lines of the file, and where they end when a torn (unparsable) tail
        follows them (None when there is none)."""
        try:
            data = self._lines(cid).read_bytes()
        except FileNotFoundError:
            return [], None
        samples: list[UsageSample] = []
        end = 0
        for line in data.splitlines(keepends=True):
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("no newline")
                samples.append(UsageSample.model_validate_json(line))
            except (ValidationError, ValueError):
                return samples, end
            end += len(line)
        return samples, None

    def _rewrite(self, cid: str, samples: list[UsageSample]) -> None:
        _write_durably(self._lines(cid),
                       "".join(s.model_dump_json() + "\n" for s in samples))

    def _save_state(self, cid: str, stream: _Stream) -> None:
        _write_durably(self._state(cid),
                       json.dumps({"next_seq": stream.next_seq, "acked": stream.acked}))


def _write_durably(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` atomically (a temporary file, fsynced, renamed); on a
    failure (a full disk) the old file stays and the temporary one is removed."""
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)
        raise


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written (a nearly full disk writes part of it
    and fails on the rest); unbuffered, so nothing is left to fail again at close."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
