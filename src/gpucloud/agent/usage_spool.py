"""Usage samples kept on the node until the server acknowledges them.

Per container ``<spool>/<cid>.jsonl`` holds its unacknowledged samples, one JSON line
each, appended and fsynced before they are sent; ``<spool>/<cid>.state`` holds the next
sequence number and the highest acknowledged one. A sample is taken, written, then sent,
all on one thread, so after a crash (SIGKILL, power loss) the spool holds every sample
the server may not have: a torn last line was never sent and is dropped, lines at or
below the acknowledged sequence are dropped on load (the crash came between saving the
state and rewriting the file), and everything else is sent again — the server stores a
(pod, attempt, seq) once, so a resend never counts twice.
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
        with self._lines(cid).open("a") as out:
            out.write(sample.model_dump_json() + "\n")
            out.flush()
            os.fsync(out.fileno())
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
        samples, torn = self._read_lines(cid)
        stream.pending = [s for s in samples if s.seq > stream.acked]
        if samples:
            stream.next_seq = max(stream.next_seq, samples[-1].seq + 1)
        if torn:
            self._rewrite(cid, stream.pending)
        return stream

    def _read_lines(self, cid: str) -> tuple[list[UsageSample], bool]:
        """The whole lines of the file, and whether a torn (unparsable) tail was left."""
        try:
            text = self._lines(cid).read_text()
        except FileNotFoundError:
            return [], False
        samples: list[UsageSample] = []
        for line in text.splitlines():
            try:
                samples.append(UsageSample.model_validate_json(line))
            except ValidationError:
                return samples, True
        return samples, False

    def _rewrite(self, cid: str, samples: list[UsageSample]) -> None:
        temporary = self._lines(cid).with_name(f".{cid}.jsonl.tmp")
        with temporary.open("w") as out:
            out.writelines(s.model_dump_json() + "\n" for s in samples)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, self._lines(cid))

    def _save_state(self, cid: str, stream: _Stream) -> None:
        temporary = self._state(cid).with_name(f".{cid}.state.tmp")
        with temporary.open("w") as out:
            json.dump({"next_seq": stream.next_seq, "acked": stream.acked}, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, self._state(cid))
