"""Reading a job's output in pieces: the cursor of ``GET /v1/jobs/{ref}/logs``, and lines.

A follower asks for what each member wrote after its *position*: the member's attempt (a
gang restart binds every member again with a new attempt, whose output starts at 0) and
an offset in UTF-8 bytes into that attempt's output, counted the way the server stores it
(the agent's log chunks). Positions travel as one query parameter,
``offsets=RANK:ATTEMPT:OFFSET[,...]``, and every answer carries the next one.

While a member's attempt runs, a follower is handed whole lines only, so that a line is
never split between two answers (and two ``[RANK] `` prefixes); once the attempt has
ended, its last partial line comes too. A line ends at ``\\n`` or ``\\r``, as
``str.splitlines`` (which renders them) sees it: progress bars that redraw with ``\\r``
show up as lines, just as in the one-shot form.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from gpucloud.core.errors import InvalidInput
from gpucloud.core.jobs import MAX_JOB_NODES

OFFSETS_FIELD = "offsets"
_POSITION = re.compile(r"([0-9]{1,18}):([0-9]{1,18}):([0-9]{1,18})")
#: The whole ``offsets`` value's grammar, as the API documents it (``parse_offsets``
#: checks it item by item, naming the item that is wrong).
OFFSETS_PATTERN = r"^([0-9]{1,18}:[0-9]{1,18}:[0-9]{1,18}(,[0-9]{1,18}:[0-9]{1,18}:[0-9]{1,18})*)?$"


class LogPosition(NamedTuple):
    """How far into one member's output a reader is: ``offset`` bytes of ``attempt``."""

    attempt: int
    offset: int


def parse_offsets(value: str) -> dict[int, LogPosition]:
    """``RANK:ATTEMPT:OFFSET,…`` as positions by rank; ``""`` is none (every member from the
    start). Malformed input is ``InvalidInput`` naming ``offsets``."""
    if value == "":
        return {}
    items = value.split(",")
    if len(items) > MAX_JOB_NODES:
        raise InvalidInput(OFFSETS_FIELD, f"at most {MAX_JOB_NODES} positions, one per rank")
    positions: dict[int, LogPosition] = {}
    for item in items:
        match = _POSITION.fullmatch(item)
        if match is None:
            raise InvalidInput(OFFSETS_FIELD, f"{item!r} is not RANK:ATTEMPT:OFFSET "
                                              "(non-negative integers)")
        rank, attempt, offset = (int(part) for part in match.groups())
        if rank in positions:
            raise InvalidInput(OFFSETS_FIELD, f"rank {rank} is given twice")
        positions[rank] = LogPosition(attempt, offset)
    return positions


def format_offsets(positions: Mapping[int, LogPosition]) -> str:
    """The inverse of ``parse_offsets``, by rank."""
    return ",".join(f"{rank}:{attempt}:{offset}"
                    for rank, (attempt, offset) in sorted(positions.items()))


def whole_lines_end(data: bytes) -> int:
    """Where the last complete line of ``data`` ends (0: none is complete).

    After its last ``\\n``, or after a later ``\\r`` that is not the last byte: a ``\\r``
    at the very end may be the first half of a ``\\r\\n`` still to come. (Both are ASCII,
    so they never occur inside a multi-byte UTF-8 sequence.)
    """
    newline = data.rfind(b"\n") + 1
    carriage = data.rfind(b"\r", 0, len(data) - 1) + 1
    return max(newline, carriage)


@dataclass(frozen=True)
class Segment:
    """One attempt's stored output from byte ``start`` on; ``ended``: no more will come."""

    attempt: int
    start: int
    data: bytes
    ended: bool


def read_segment(segment: Segment, *, whole_only: bool,
                 tail: int | None = None) -> tuple[list[str], int]:
    """The lines to hand out of ``segment`` (the last ``tail`` of them, if given) and the
    offset after what was handed out.

    ``whole_only`` holds back a trailing partial line while the attempt runs; otherwise
    (the one-shot form, or an ended attempt) the partial line is a line of its own.
    """
    data = segment.data
    end = whole_lines_end(data) if whole_only and not segment.ended else len(data)
    lines = data[:end].decode(errors="replace").splitlines()
    if tail is not None:
        lines = lines[-tail:] if tail else []
    return lines, segment.start + end


def prefixed(rank: int, lines: Iterable[str]) -> str:
    """Lines as ``job logs`` prints them: ``[RANK] line``, each ending with a newline."""
    return "".join(f"[{rank}] {line}\n" for line in lines)
