"""A job's history: what its members wrote (logs) and what happened to them (events).

Logs are read from the agents' chunks (``pod_log_chunks``, by attempt and byte offset);
``core.joblogs`` holds the cursor and line rules. Reads go job, then members, then chunks:
a member that has ended had its last chunk stored before its end was reported (the agent
ships everything first), so on PostgreSQL, where each statement sees its own snapshot, a
later statement sees every chunk of a member an earlier one saw ended.
"""

from __future__ import annotations

from itertools import groupby
from typing import NamedTuple

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from gpucloud.core.errors import InvalidInput
from gpucloud.core.joblogs import (
    OFFSETS_FIELD,
    LogPosition,
    Segment,
    format_offsets,
    prefixed,
    read_segment,
)
from gpucloud.core.jobs import (
    JOB_FINAL_PHASES,
    JobEventOut,
    JobLogMemberOut,
    JobLogsOut,
    JobPhase,
)
from gpucloud.core.phases import ACTIVE_PHASES, PodPhase
from gpucloud.db.models import PodEventModel, PodLogChunkModel, PodModel
from gpucloud.services.context import ServiceContext
from gpucloud.services.jobs import find_job
from gpucloud.services.projects import Principal


class Member(NamedTuple):
    """What reading a member's output needs of its pod."""

    pod_id: str
    rank: int
    attempt: int
    phase: str
    log_tail: str | None


#: A stored chunk: (attempt, offset, data).
Chunk = tuple[int, int, str]


def job_logs(ctx: ServiceContext, caller: Principal, ref: str,
             positions: dict[int, LogPosition] | None = None,
             tail: int | None = None) -> JobLogsOut:
    """Every member's output, each line prefixed by its rank.

    Without ``positions`` (the one-shot form): all of each member's current attempt,
    partial last lines included. With them (following): what each member wrote after its
    position, whole lines only while it runs; a member left out starts at the beginning of
    its current attempt. ``tail`` keeps the last lines of each member that starts afresh.
    """
    with ctx.db.read() as session:
        job = find_job(session, caller, ref)
        ended = JobPhase(job.phase) in JOB_FINAL_PHASES
        members = _members(session, job.id)
        _check_positions(job.name, members, positions or {})
        read = [_read_member(session, member, positions, tail) for member in members]
    outs = [out for _, out in read]
    return JobLogsOut(
        text="".join(text for text, _ in read),
        finished=ended and all(out.finished for out in outs), members=outs,
        offsets=format_offsets({o.rank: LogPosition(o.attempt, o.next_offset) for o in outs}),
    )


def _members(session: Session, job_id: str) -> list[Member]:
    rows = session.execute(
        select(PodModel.id, func.coalesce(PodModel.rank, 0), PodModel.attempt, PodModel.phase,
               PodModel.log_tail)
        .where(PodModel.job_id == job_id).order_by(PodModel.rank)
    )
    return [Member(*row) for row in rows]


def _check_positions(job_name: str, members: list[Member],
                     positions: dict[int, LogPosition]) -> None:
    """Each position must name a rank of the job and an attempt it has had."""
    attempts = {member.rank: member.attempt for member in members}
    for rank, position in sorted(positions.items()):
        if rank not in attempts:
            raise InvalidInput(OFFSETS_FIELD, f"job {job_name!r} has no rank {rank}")
        if position.attempt > attempts[rank]:
            raise InvalidInput(OFFSETS_FIELD, f"rank {rank} is on attempt {attempts[rank]}; "
                                              f"it has had no attempt {position.attempt}")


def _read_member(session: Session, member: Member, positions: dict[int, LogPosition] | None,
                 tail: int | None) -> tuple[str, JobLogMemberOut]:
    """The member's new lines, prefixed, and where it stands after them."""
    rank, attempt = member.rank, member.attempt
    ended = PodPhase(member.phase) not in ACTIVE_PHASES
    position = (positions or {}).get(rank)
    start = position or LogPosition(attempt, 0)
    chunks = _chunks(session, member.pod_id, start, attempt)
    lines: list[str] = []
    offset = 0
    for segment in _segments(member, start, chunks, ended):
        got, offset = read_segment(segment, whole_only=positions is not None,
                                   tail=tail if position is None else None)
        lines.extend(got)
    return prefixed(rank, lines), JobLogMemberOut(rank=rank, attempt=attempt,
                                                  next_offset=offset, finished=ended)


def _chunks(session: Session, pod_id: str, start: LogPosition, current: int) -> list[Chunk]:
    """Chunks of attempts ``start.attempt`` to ``current``, the first from the one that
    holds ``start.offset`` (so a follower does not read the whole log again each time)."""
    log = PodLogChunkModel
    first = (select(func.coalesce(func.max(log.offset), 0))
             .where(log.pod_id == pod_id, log.attempt == start.attempt,
                    log.offset <= start.offset)
             .scalar_subquery())
    rows = session.execute(
        select(log.attempt, log.offset, log.data)
        .where(log.pod_id == pod_id, log.attempt >= start.attempt, log.attempt <= current,
               or_(log.attempt > start.attempt, log.offset >= first))
        .order_by(log.attempt, log.offset)
    )
    return [(attempt, offset, data) for attempt, offset, data in rows]


def _segments(member: Member, start: LogPosition, chunks: list[Chunk],
              ended: bool) -> list[Segment]:
    """One segment per attempt from ``start`` on that has output, and the current one.

    An attempt before the current one has ended. The current one, ended with no chunk
    stored, falls back to the log tail its agent sent with its last status (as
    ``pod logs`` does; binding a member again clears the tail).
    """
    current = member.attempt
    stored = {attempt: [(offset, data) for _, offset, data in rows]
              for attempt, rows in groupby(chunks, key=lambda chunk: chunk[0])}
    if ended and not stored.get(current) and member.log_tail:
        stored[current] = [(0, member.log_tail)]
    return [
        _segment(attempt, stored.get(attempt, []),
                 start.offset if attempt == start.attempt else 0, ended or attempt < current)
        for attempt in sorted({start.attempt, current, *stored})
    ]


def _segment(attempt: int, rows: list[tuple[int, str]], offset: int, ended: bool) -> Segment:
    """The attempt's output from ``offset`` (clamped to what is stored)."""
    base = rows[0][0] if rows else 0
    data = b"".join(text.encode() for _, text in rows)
    cut = min(max(offset - base, 0), len(data))
    return Segment(attempt=attempt, start=base + cut, data=data[cut:], ended=ended)


def job_events(ctx: ServiceContext, caller: Principal, ref: str) -> list[JobEventOut]:
    """Every stored event of the job's members, oldest first, each with its member's rank."""
    with ctx.db.read() as session:
        job = find_job(session, caller, ref)
        rows = session.execute(
            select(PodEventModel, func.coalesce(PodModel.rank, 0), PodModel.name)
            .join(PodModel, PodModel.id == PodEventModel.pod_id)
            .where(PodModel.job_id == job.id)
            .order_by(PodEventModel.time, PodEventModel.id)
        ).all()
        return [
            JobEventOut(time=event.time, rank=rank, pod=pod, reason=event.reason,
                        message=event.message,
                        from_phase=PodPhase(event.from_phase) if event.from_phase else None,
                        to_phase=PodPhase(event.to_phase) if event.to_phase else None)
            for event, rank, pod in rows
        ]
