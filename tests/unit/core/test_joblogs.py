"""The cursor and line rules of following a job's logs (core.joblogs)."""

from __future__ import annotations

import pytest

from gpucloud.core.errors import InvalidInput
from gpucloud.core.joblogs import (
    LogPosition,
    Segment,
    format_offsets,
    parse_offsets,
    prefixed,
    read_segment,
    whole_lines_end,
)
from gpucloud.core.jobs import MAX_JOB_NODES


def test_offsets_parse_and_format_round_trip() -> None:
    positions = parse_offsets("1:2:0,0:2:1234")
    assert positions == {0: LogPosition(2, 1234), 1: LogPosition(2, 0)}
    assert format_offsets(positions) == "0:2:1234,1:2:0"
    assert parse_offsets("") == {}
    assert format_offsets({}) == ""


@pytest.mark.parametrize(("value", "says"), [
    ("0:1", "'0:1' is not RANK:ATTEMPT:OFFSET"),
    ("0:1:2:3", "is not RANK:ATTEMPT:OFFSET"),
    ("a:1:2", "'a:1:2' is not"),
    ("0:1:-2", "'0:1:-2' is not"),
    ("0:1:2,", "'' is not"),
    (" 0:1:2", "' 0:1:2' is not"),
    ("0:1:١٢", "is not"),  # digits, but not ASCII ones
    ("0:1:1234567890123456789", "is not"),  # past what a 64-bit column holds
    ("0:1:2,0:1:3", "rank 0 is given twice"),
    (",".join(f"{rank}:0:0" for rank in range(MAX_JOB_NODES + 1)), "at most 1024"),
])
def test_bad_offsets_name_the_field(value: str, says: str) -> None:
    with pytest.raises(InvalidInput) as raised:
        parse_offsets(value)
    assert raised.value.field == "offsets"
    assert raised.value.message.startswith("offsets: ") and says in raised.value.message


@pytest.mark.parametrize(("data", "end"), [
    (b"", 0), (b"partial", 0), (b"a\nb", 2), (b"a\nb\n", 4),
    (b"a\r", 0),  # may be the first half of a \r\n
    (b"a\rb", 2), (b"a\r\n", 3), (b"a\r\nb\r", 3), (b"10%\r20%\r30", 8),
    ("é\n".encode(), 3),
])
def test_whole_lines_end(data: bytes, end: int) -> None:
    assert whole_lines_end(data) == end


def _segment(data: bytes, ended: bool = False, start: int = 100) -> Segment:
    return Segment(attempt=1, start=start, data=data, ended=ended)


def test_a_running_attempt_hands_out_whole_lines_only() -> None:
    assert read_segment(_segment(b"one\ntwo\nthr"), whole_only=True) == (["one", "two"], 108)
    assert read_segment(_segment(b"thr"), whole_only=True) == ([], 100)


def test_an_ended_attempt_gives_its_partial_line_too() -> None:
    assert read_segment(_segment(b"one\nthr", ended=True), whole_only=True) == (
        ["one", "thr"], 107)


def test_the_one_shot_form_shows_partial_lines() -> None:
    assert read_segment(_segment(b"one\nthr"), whole_only=False) == (["one", "thr"], 107)


def test_offsets_count_utf8_bytes() -> None:
    lines, end = read_segment(_segment("héllo\nwörld".encode(), start=0), whole_only=True)
    assert (lines, end) == (["héllo"], 7)


def test_carriage_returns_split_lines_as_the_one_shot_form_does() -> None:
    data = b"epoch 1\r\n10%\r20%\r"
    assert read_segment(_segment(data, start=0), whole_only=True) == (
        ["epoch 1", "10%"], 13)


@pytest.mark.parametrize(("tail", "lines"), [
    (0, []), (1, ["c"]), (2, ["b", "c"]), (9, ["a", "b", "c"]),
])
def test_tail_keeps_the_last_lines(tail: int, lines: list[str]) -> None:
    got, end = read_segment(_segment(b"a\nb\nc\npart", start=0), whole_only=True, tail=tail)
    assert (got, end) == (lines, 6)


def test_prefixed_is_the_job_logs_format() -> None:
    assert prefixed(3, ["a", "", "b"]) == "[3] a\n[3] \n[3] b\n"
    assert prefixed(0, []) == ""
