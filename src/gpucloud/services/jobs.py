"""Jobs: user intent (create, stop, delete) and what the user reads back.

A job is recorded with its N member pods (``NAME-RANK``, Pending) in one transaction; the
controller side (``services.gangs``) places, starts and restarts them as one unit. What its
members wrote and what happened to them is read in ``services.job_history``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpucloud.core.errors import Conflict, InvalidInput, NotFound
from gpucloud.core.jobs import (
    JOB_FINAL_PHASES,
    JobCreateRequest,
    JobMemberOut,
    JobOut,
    JobPhase,
    JobWhyOut,
    Topology,
    master_port,
    member_name,
)
from gpucloud.core.names import MAX_NAME_LENGTH
from gpucloud.core.phases import ACTIVE_PHASES, PodPhase, RestartPolicy
from gpucloud.core.spot import priority_class_of
from gpucloud.db.models import JobModel, NodeModel, PodModel
from gpucloud.scheduler import Explanation
from gpucloud.services import admission, backfill, gangs, priorities
from gpucloud.services.context import ServiceContext, new_id
from gpucloud.services.events import record_event
from gpucloud.services.pods import bump_assignments
from gpucloud.services.projects import Principal
from gpucloud.services.scheduling import snapshot
from gpucloud.services.spec import check_mig, check_spec, copy_columns, spec_columns, spec_out
from gpucloud.services.transparent import check_transparent


def create_job(ctx: ServiceContext, caller: Principal, request: JobCreateRequest) -> JobOut:
    """Record the job and its Pending members in one transaction."""
    _check_member_names(request)
    check_spec(ctx, caller.project_id, request)
    check_mig(request, request.gpus_per_node)
    check_transparent(ctx, request, gpus=request.gpus_per_node, nodes=request.nodes,
                      job=True)
    now = ctx.clock.now()
    priority = priorities.resolve_cached(ctx, priority_class_of(request,
                                                                request.priority_class))
    job = _new_job(caller, request, now, priority)
    try:
        with ctx.db.transaction() as session:
            _check_names_free(session, caller, request)
            members = [_member(job, rank, now) for rank in range(request.nodes)]
            admission.admit(ctx, session, caller, [_rate_columns(m) for m in members])
            session.add(job)
            session.flush()
            session.add_all(members)
            session.flush()
            return _job_out(session, job, caller.project_name)
    except IntegrityError:
        raise InvalidInput("name", f"a job named {request.name!r} or one of its member pods "
                           "was just created") from None


def _check_member_names(request: JobCreateRequest) -> None:
    longest = member_name(request.name, request.nodes - 1)
    if len(longest) > MAX_NAME_LENGTH:
        raise InvalidInput("name", f"too long: member pods are named like {longest!r}, "
                           f"which must be at most {MAX_NAME_LENGTH} characters")


def _check_names_free(session: Session, caller: Principal, request: JobCreateRequest) -> None:
    taken = session.scalar(select(JobModel.id).where(
        JobModel.project_id == caller.project_id, JobModel.name == request.name,
        JobModel.deleted_at.is_(None)))
    if taken is not None:
        raise InvalidInput("name", f"a job named {request.name!r} already exists in project "
                           f"{caller.project_name!r}")
    names = [member_name(request.name, rank) for rank in range(request.nodes)]
    pod = session.scalar(select(PodModel.name).where(
        PodModel.project_id == caller.project_id, PodModel.name.in_(names),
        PodModel.deleted_at.is_(None)))
    if pod is not None:
        raise InvalidInput("name", f"a pod named {pod!r} already exists; the job's members "
                           f"are named {names[0]!r} …")


def _new_job(caller: Principal, request: JobCreateRequest, now: datetime,
             priority: tuple[str, int]) -> JobModel:
    return JobModel(
        id=new_id(), project_id=caller.project_id, name=request.name,
        phase=JobPhase.PENDING.value, reason="Created", message=None, desired_state="running",
        gang_state=gangs.QUEUED, teardown=None, num_nodes=request.nodes,
        gpus_per_node=request.gpus_per_node, topology=request.topology.value,
        priority_class=priority[0], priority=priority[1],
        max_restarts=request.max_restarts, restarts=0,
        max_duration_seconds=request.max_duration,
        ready_timeout_seconds=request.ready_timeout, ready_timeouts=0, created_at=now,
        updated_at=now, version=0, **spec_columns(request),
    )


def _member(job: JobModel, rank: int, now: datetime) -> PodModel:
    """A member pod: never restarted on its own (the gang restarts as a unit)."""
    return PodModel(
        id=new_id(), project_id=job.project_id, name=member_name(job.name, rank),
        phase=PodPhase.PENDING.value, reason="Created", desired_state="running", ports=[],
        gpus=float(job.gpus_per_node), restart_policy=RestartPolicy.NEVER.value,
        priority_class=job.priority_class, priority=job.priority,
        max_duration_seconds=job.max_duration_seconds, gpu_uuids=[], gpu_milli={},
        attempt=0, restart_count=0, job_id=job.id, rank=rank,
        created_at=now, updated_at=now, version=0, **copy_columns(job),
    )


def _rate_columns(member: PodModel) -> dict[str, Any]:
    """What the spend limit prices a member by (as for a pod's row)."""
    return {"gpus": member.gpus, "gpu_type": member.gpu_type, "spot": member.spot,
            "cpu_milli": member.cpu_milli, "volume_bytes": member.volume_bytes}


def _job_out(session: Session, job: JobModel, project: str) -> JobOut:
    rows = session.execute(
        select(PodModel, NodeModel.name, NodeModel.address)
        .outerjoin(NodeModel, NodeModel.id == PodModel.node_id)
        .where(PodModel.job_id == job.id).order_by(PodModel.rank)
    ).all()
    members = [
        JobMemberOut(rank=pod.rank or 0, pod=pod.name, pod_id=pod.id,
                     phase=PodPhase(pod.phase), node=node, address=address,
                     reason=pod.reason, exit_code=pod.exit_code,
                     ready=pod.ready_at is not None)
        for pod, node, address in rows
    ]
    return JobOut(
        id=job.id, name=job.name, project=project, phase=JobPhase(job.phase),
        reason=job.reason, message=job.message, nodes=job.num_nodes,
        gpus_per_node=job.gpus_per_node, topology=Topology(job.topology),
        priority_class=job.priority_class, priority=job.priority,
        max_duration=job.max_duration_seconds,
        max_restarts=job.max_restarts, restarts=job.restarts,
        ready_timeout=job.ready_timeout_seconds, master_port=master_port(job.id),
        barrier_released=job.barrier_released_at is not None,
        desired_state=job.desired_state, members=members, created_at=job.created_at,
        updated_at=job.updated_at, started_at=job.started_at, finished_at=job.finished_at,
        preemptions=job.preemptions, last_preemption_reason=job.last_preemption_reason,
        last_preempted_at=job.last_preempted_at, time_lost_seconds=job.time_lost_seconds,
        **spec_out(job),
    )


def find_job(session: Session, caller: Principal, ref: str, lock: bool = False) -> JobModel:
    """A live job of the caller's project by id or name; NotFound hides other projects."""
    query = select(JobModel).where(
        JobModel.project_id == caller.project_id, JobModel.deleted_at.is_(None),
        (JobModel.id == ref) | (JobModel.name == ref))
    job = session.scalar(query.with_for_update() if lock else query)
    if job is None:
        raise NotFound(f"job {ref!r} not found")
    return job


def get_job(ctx: ServiceContext, caller: Principal, ref: str) -> JobOut:
    with ctx.db.transaction() as session:
        return _job_out(session, find_job(session, caller, ref), caller.project_name)


def list_jobs(ctx: ServiceContext, caller: Principal, limit: int = 1000) -> list[JobOut]:
    with ctx.db.transaction() as session:
        jobs = session.scalars(
            select(JobModel)
            .where(JobModel.project_id == caller.project_id, JobModel.deleted_at.is_(None))
            .order_by(JobModel.created_at, JobModel.id).limit(limit)
        ).all()
        return [_job_out(session, job, caller.project_name) for job in jobs]


def why_job(ctx: ServiceContext, caller: Principal, ref: str) -> JobWhyOut:
    with ctx.db.transaction() as session:
        job = find_job(session, caller, ref)
        members = session.scalars(select(PodModel).where(PodModel.job_id == job.id)).all()
        reasons = job.unschedulable or {}
        summary = _why_summary(ctx, job, list(members))
        blocked = job.gang_state == gangs.QUEUED and job.reason == "Unschedulable"
        job_id, name, phase = job.id, job.name, JobPhase(job.phase)
    held = backfill.head_reservation(ctx, snapshot(ctx).nodes) if blocked else None
    if held is not None and held.job_id == job_id:
        summary = f"{summary}; {held.describe()}"
    return JobWhyOut(job=name, phase=phase, summary=summary, reasons=reasons)


def _why_summary(ctx: ServiceContext, job: JobModel, members: list[PodModel]) -> str:
    state = job.gang_state
    if state == gangs.QUEUED:
        if job.not_before and job.not_before > ctx.clock.now() and job.reason != "Unschedulable":
            return f"{job.message}; waiting until {job.not_before.isoformat()} (back-off)"
        if job.unschedulable is not None:
            return job.message or Explanation(job.unschedulable).summary()
        if job.reason in {"OverQuota", "Preempting"} and job.message:
            return job.message
        return "waiting for the scheduler's next pass"
    if state == gangs.STARTING:
        ready = sum(m.ready_at is not None for m in members)
        return (f"placed ({job.message}); {ready} of {len(members)} members ready at the "
                f"start barrier (ready timeout {job.ready_timeout_seconds:g}s)")
    if state == gangs.STOPPING:
        return f"stopping every member: {job.message}"
    return f"job is {job.phase}" + (f": {job.message}" if job.message else "")


def stop_job(ctx: ServiceContext, caller: Principal, ref: str) -> JobOut:
    """Stop every member (through the agents); the job ends Stopped once all have."""
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        job = find_job(session, caller, ref, lock=True)
        if JobPhase(job.phase) in JOB_FINAL_PHASES:
            raise Conflict(f"job {job.name!r} is not running (phase {job.phase})")
        job.desired_state = "stopped"
        members = gangs.lock_members(session, job.id)
        gangs.teardown(ctx, session, job, members, now, gangs.STOP,
                       ("StoppedByUser", "stopped by the user"))
        return _job_out(session, job, caller.project_name)


def delete_job(ctx: ServiceContext, caller: Principal, ref: str) -> None:
    """Delete a job and its members; running members are stopped by their agents."""
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        job = find_job(session, caller, ref, lock=True)
        job.deleted_at = now
        job.desired_state = "deleted"
        job.gang_state = gangs.ENDED
        job.version += 1
        for member in gangs.lock_members(session, job.id):
            member.deleted_at = now
            member.desired_state = "deleted"
            member.version += 1
            record_event(session, member.id, now, "Deleted", f"job {job.name} deleted")
            if PodPhase(member.phase) in ACTIVE_PHASES:
                bump_assignments(session, member.node_id)
