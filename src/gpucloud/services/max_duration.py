"""Declared max durations, enforced: running work past its ``--max-duration`` is stopped
with reason ``MaxDurationExceeded``.

Backfill (``services.backfill``) lets work that declares a max duration use nodes reserved
for a blocked gang, trusting that it ends in time; this step makes the declaration hold.
A pod is timed from its start (``Running``), a job from the release of its start barrier.
A stopped pod gets its grace period (SIGTERM, then SIGKILL) from its agent.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import cast

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from gpucloud.core.phases import PodPhase
from gpucloud.db.models import JobModel, PodModel
from gpucloud.db.session import rows_changed
from gpucloud.services import gangs
from gpucloud.services.context import ServiceContext
from gpucloud.services.events import record_event
from gpucloud.services.pods import bump_assignments

EXCEEDED = "MaxDurationExceeded"


#: The candidates, built once (every controller pass asks): running pods and jobs that
#: declare a max duration.
_RUNNING_PODS = (
    select(PodModel.id, PodModel.version, PodModel.started_at,
           PodModel.max_duration_seconds, PodModel.node_id)
    .where(PodModel.phase == PodPhase.RUNNING.value, PodModel.job_id.is_(None),
           PodModel.max_duration_seconds.is_not(None),
           PodModel.desired_state == "running", PodModel.deleted_at.is_(None)))
_RUNNING_JOBS = select(JobModel.id).where(JobModel.gang_state == gangs.RUNNING,
                                          JobModel.max_duration_seconds.is_not(None),
                                          JobModel.desired_state == "running")


def enforce(ctx: ServiceContext) -> list[str]:
    """Stop every pod and job that has run past its max duration; returns their ids.

    The candidates are read in one read transaction (no write lock, no fence: most passes
    find none); each stop is its own guarded, fenced write."""
    now = ctx.clock.now()
    with ctx.db.read() as session:
        connection = session.connection()
        pods = [cast(_Candidate, tuple(row)) for row in connection.execute(_RUNNING_PODS)]
        jobs = [job_id for (job_id,) in connection.execute(_RUNNING_JOBS)]
    return [*_stop_pods(ctx, now, pods), *_stop_jobs(ctx, now, jobs)]


def _overdue(started: datetime | None, max_duration: float | None, now: datetime) -> bool:
    if started is None or max_duration is None:
        return False
    aware = started if started.tzinfo else started.replace(tzinfo=UTC)
    return aware + timedelta(seconds=max_duration) <= now


def _message(max_duration: float) -> str:
    return f"ran longer than its max duration ({max_duration:g}s)"


#: A candidate pod: id, version, started at, max duration, node id.
_Candidate = tuple[str, int, datetime | None, float | None, str | None]


def _stop_pods(ctx: ServiceContext, now: datetime, rows: Sequence[_Candidate]) -> list[str]:
    stopped = []
    for pod_id, version, started, max_duration, node_id in rows:
        if max_duration is not None and _overdue(started, max_duration, now):
            with ctx.db.transaction() as session:
                if _stop_pod(session, pod_id, version, _message(max_duration), now):
                    bump_assignments(session, node_id)
                    stopped.append(pod_id)
    return stopped


def _stop_pod(session: Session, pod_id: str, version: int, why: str, now: datetime) -> bool:
    """Guarded on the pod's version: a pod stopped or changed meanwhile is left alone."""
    changed = rows_changed(session, update(PodModel).where(
        PodModel.id == pod_id, PodModel.version == version,
        PodModel.phase == PodPhase.RUNNING.value, PodModel.desired_state == "running",
    ).values(desired_state="stopped", reason=EXCEEDED, message=why, updated_at=now,
             version=PodModel.version + 1))
    if changed:
        record_event(session, pod_id, now, EXCEEDED, why)
    return bool(changed)


def _stop_jobs(ctx: ServiceContext, now: datetime, ids: list[str]) -> list[str]:
    stopped = []
    for job_id in ids:
        with ctx.db.transaction() as session:
            job = session.get_one(JobModel, job_id, with_for_update=True)
            if job.gang_state != gangs.RUNNING or job.desired_state != "running" or (
                    not _overdue(job.barrier_released_at, job.max_duration_seconds, now)):
                continue
            assert job.max_duration_seconds is not None
            job.desired_state = "stopped"
            gangs.teardown(ctx, session, job, gangs.lock_members(session, job.id), now,
                           gangs.STOP, (EXCEEDED, _message(job.max_duration_seconds)))
            stopped.append(job_id)
    return stopped
