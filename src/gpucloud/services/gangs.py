"""Jobs as gangs, the controller's side: placement, the start barrier, restarts as a unit.

- **Placement** (``run_pass``): lease queued jobs, snapshot the cluster outside any
  transaction, ask ``scheduler.gang.place_gang`` for one node per member, and bind every
  member in ONE transaction guarded on the job's version and lock, each node's version and
  each member's version: all binds land or none does.
- **Start barrier**: a member's agent creates its container, reports it ready
  (``report_ready``) and waits; ``reconcile`` releases the barrier for all members at
  once (``barrier_released`` in their assignments) when every member is ready. A gang not
  ready within ``ready_timeout`` is stopped and requeued with exponential back-off.
- **Restarts** (``reconcile``): one member failing, or lost with its node, stops the whole
  gang; once every member has ended it is requeued as a unit, up to ``max_restarts``, then
  the job is ``Failed`` with the reason.

Lock order, on PostgreSQL: job row, then member nodes, then member pods (agents lock a
node, then its pod), so these transactions never deadlock with agents or each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from gpucloud.core.errors import Conflict, NotFound
from gpucloud.core.jobs import (
    AgentPodReadyRequest,
    JobPhase,
    Topology,
    master_port,
    rendezvous_env,
)
from gpucloud.core.phases import ACTIVE_PHASES, TERMINAL_PHASES, PodPhase
from gpucloud.db.models import JobModel, NodeModel, PodModel
from gpucloud.db.session import rows_changed
from gpucloud.scheduler import NodeState, Placement, PodRequest, Scheduler
from gpucloud.scheduler.gang import GangDecision, place_gang
from gpucloud.scheduler.preemption import with_placements
from gpucloud.scheduler.quota import Ledger, drf_capacity, gpu_capacity
from gpucloud.scheduler.types import FULL_GPU_MILLI
from gpucloud.services import backfill, quotas, spot
from gpucloud.services.context import ServiceContext, new_id
from gpucloud.services.events import record_event, transition
from gpucloud.services.fencing import check_fencing
from gpucloud.services.pods import bump_assignments, requeue
from gpucloud.services.scheduling import (
    LOCK_SECONDS,
    OVER_QUOTA,
    UNSCHEDULABLE_RETRY_SECONDS,
    Snapshot,
    claim_node,
    quota_model,
    reservation_free,
    retry_marked,
    snapshot,
)

QUEUED, STARTING, RUNNING, STOPPING, ENDED = "queued", "starting", "running", "stopping", "ended"
#: What follows a teardown: a restart (counts against max_restarts), a requeue after the
#: ready timeout (its own back-off), a requeue after preemption (no back-off, no count),
#: or the end (a user's stop).
RESTART, REQUEUE, PREEMPT, STOP = "restart", "requeue", "preempt", "stop"


@dataclass
class JobPassResult:
    considered: int = 0
    placed: list[str] = field(default_factory=list)
    unschedulable: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    over_quota: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LeasedJob:
    id: str
    version: int
    topology: Topology
    gpus_per_node: int
    gpu_type: str | None
    cpu_milli: int
    memory_bytes: int
    env: dict[str, str]
    members: list[tuple[str, int]]  # (pod id, version) by rank
    project_id: str = ""
    priority: int = 0
    #: The members' reservations (node id, GPU index -> milli) by rank, while they hold.
    reservations: list[tuple[str, dict[str, int]]] | None = None
    max_duration: float | None = None
    #: Nodes the gang was just preempted from (services/spot).
    avoid_nodes: tuple[str, ...] = ()
    #: ``--mig PROFILE``: each member takes one MIG instance (all of them or none).
    mig_profile: str | None = None


# -- placement ----------------------------------------------------------------------------


def lease_queued(ctx: ServiceContext, limit: int) -> tuple[str, list[LeasedJob]]:
    """Take a lock on up to ``limit`` queued jobs whose back-off is over, oldest first."""
    now = ctx.clock.now()
    token = new_id()
    queued = (
        select(JobModel.id)
        .where(JobModel.gang_state == QUEUED, JobModel.deleted_at.is_(None),
               JobModel.desired_state == "running",
               or_(JobModel.not_before.is_(None), JobModel.not_before <= now),
               or_(JobModel.lock_expires_at.is_(None), JobModel.lock_expires_at <= now))
        .order_by(JobModel.priority.desc(), JobModel.created_at, JobModel.id).limit(limit))
    # Most passes find no job: a read says so without the write transaction (SQLite's
    # write lock, the leader's fence) that taking the locks needs.
    with ctx.db.read() as session:
        if session.scalar(queued) is None:
            return token, []
    with ctx.db.transaction() as session:
        ids = session.scalars(queued).all()
        if not ids:
            return token, []
        session.execute(
            update(JobModel)
            .where(JobModel.id.in_(ids),
                   or_(JobModel.lock_expires_at.is_(None), JobModel.lock_expires_at <= now))
            .values(lock_token=token, lock_expires_at=now + timedelta(seconds=LOCK_SECONDS))
        )
        jobs = session.scalars(select(JobModel).where(JobModel.lock_token == token)
                               .order_by(JobModel.priority.desc(), JobModel.created_at,
                                         JobModel.id)).all()
        return token, [leased_job(session, job, now) for job in jobs]


def leased_job(session: Session, job: JobModel, now: datetime | None = None) -> LeasedJob:
    members = session.execute(
        select(PodModel.id, PodModel.version, PodModel.nominated_node_id,
               PodModel.nominated_gpu_milli).where(PodModel.job_id == job.id)
        .order_by(PodModel.rank)
    ).all()
    held = now is not None and job.nominated_until is not None and job.nominated_until > now
    reservations = [(node_id, milli) for _, _, node_id, milli in members
                    if node_id and milli is not None]
    return LeasedJob(job.id, job.version, Topology(job.topology), job.gpus_per_node,
                     job.gpu_type, job.cpu_milli, job.memory_bytes, dict(job.env),
                     [(pod_id, version) for pod_id, version, _, _ in members],
                     job.project_id, job.priority,
                     reservations if held and len(reservations) == len(members) else None,
                     job.max_duration_seconds, _avoided(session, job.id, now),
                     job.mig_profile)


def _avoided(session: Session, job_id: str, now: datetime | None) -> tuple[str, ...]:
    """The nodes the gang was just preempted from: no member goes back there for a while."""
    if now is None:
        return ()
    return tuple(sorted(set(session.scalars(
        select(NodeModel.name).join(PodModel, PodModel.avoid_node_id == NodeModel.id)
        .where(PodModel.job_id == job_id, PodModel.avoid_until > now)))))


def member_requests(job: LeasedJob) -> list[PodRequest]:
    gpus = 0 if job.mig_profile else job.gpus_per_node
    return [PodRequest(key=pod_id, gpus=gpus, gpu_model=job.gpu_type,
                       mig_profile=job.mig_profile,
                       cpu_milli=job.cpu_milli, memory_bytes=job.memory_bytes,
                       avoid_nodes=job.avoid_nodes)
            for pod_id, _ in job.members]


def run_pass(ctx: ServiceContext, scheduler: Scheduler, limit: int = 32) -> JobPassResult:
    """Place up to ``limit`` queued jobs, each whole or not at all: jobs holding
    reservations onto them once the victims are gone, the others within their project's
    quota, by priority, then dominant share (DRF), then age."""
    retry_marked(ctx)
    token, jobs = lease_queued(ctx, limit)
    result = JobPassResult(considered=len(jobs))
    if not jobs:
        return result
    snap = snapshot(ctx)
    nodes: list[NodeState] = snap.nodes
    versions = {name: node.version for name, node in snap.by_name.items()}
    with ctx.db.transaction() as session:
        ledger = quotas.load_ledger(session, ctx.clock.now())
        names = quotas.project_names(session)
    capacity = gpu_capacity(nodes)
    held = backfill.head_reservation(ctx, nodes)
    for job in _fair_order(jobs, ledger, drf_capacity(nodes)):
        if job.reservations is not None:
            _bind_reserved(ctx, job, token, snap, versions, result)
            continue
        milli = len(job.members) * job.gpus_per_node * FULL_GPU_MILLI
        model = quota_model(ledger, job.project_id, job.gpu_type, milli, capacity)
        if milli and model is not None and not ledger.admits(job.project_id, model, milli):
            message = ledger.over_quota_message(
                job.project_id, names.get(job.project_id, job.project_id), model, milli)
            _mark_waiting(ctx, job, token, OVER_QUOTA, message)
            result.over_quota.append(job.id)
            continue
        requests = member_requests(job)
        decision = _place(ctx, scheduler, nodes, job, held)
        if decision.placements is None:
            _mark_unschedulable(ctx, job, token, decision)
            result.unschedulable.append(job.id)
            held = held or backfill.head_reservation(ctx, nodes)
        elif _bind(ctx, job, token, decision, snap.by_name, versions):
            nodes = with_placements(nodes, requests, decision.placements)
            if model is not None:
                ledger.add(job.project_id, model, milli)
            result.placed.append(job.id)
            held = None if held is not None and held.job_id == job.id else held
        else:
            _release_lock(ctx, job, token)
            result.conflicts.append(job.id)
    return result


def _place(ctx: ServiceContext, scheduler: Scheduler, nodes: list[NodeState], job: LeasedJob,
           held: backfill.GangReservation | None) -> GangDecision:
    """Place the gang; while another blocked gang holds a backfill reservation, off its
    nodes unless this job ends in time (declared max duration) or outranks that gang."""
    requests = member_requests(job)
    if held is None or held.job_id == job.id or not held.closes(
            job.priority, job.max_duration, ctx.clock.now()):
        return place_gang(scheduler, nodes, requests, job.topology)
    decision = place_gang(scheduler, backfill.restricted(nodes, held), requests, job.topology)
    closed = backfill.closed_count(nodes, held)
    if decision.placements is not None or closed == 0:
        return decision
    return GangDecision(None, decision.domain, f"{decision.summary}; {closed} "
                        f"node{'' if closed == 1 else 's'} {held.label()}",
                        backfill.explain(decision.explanation, closed, held))


def _fair_order(jobs: list[LeasedJob], ledger: Ledger,
                capacity: dict[str, int]) -> list[LeasedJob]:
    """Priority first; among equals, the smallest dominant share (DRF), then lease order."""
    shares = {j.project_id: ledger.dominant_share(j.project_id, capacity) for j in jobs}
    order = {j.id: i for i, j in enumerate(jobs)}
    return sorted(jobs, key=lambda j: (-j.priority, shares[j.project_id], order[j.id]))


def _bind_reserved(ctx: ServiceContext, job: LeasedJob, token: str, snap: Snapshot,
                   versions: dict[str, int], result: JobPassResult) -> None:
    """Bind every member onto its reservation once all of them are free; else wait."""
    assert job.reservations is not None
    if not all(reservation_free(snap, node_id, milli) for node_id, milli in job.reservations):
        _release_lock(ctx, job, token)
        result.waiting.append(job.id)
        return
    names = {node.id: name for name, node in snap.by_name.items()}
    placements = tuple(Placement(names[node_id], {int(i): m for i, m in milli.items()})
                       for node_id, milli in job.reservations)
    decision = GangDecision(placements, None, "placed on the capacity preemption freed")
    if _bind(ctx, job, token, decision, snap.by_name, versions):
        result.placed.append(job.id)
    else:
        _release_lock(ctx, job, token)
        result.conflicts.append(job.id)


def _mark_waiting(ctx: ServiceContext, job: LeasedJob, token: str, reason: str,
                  message: str) -> None:
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        session.execute(
            update(JobModel)
            .where(JobModel.id == job.id, JobModel.lock_token == token,
                   JobModel.version == job.version)
            .values(unschedulable=None, reason=reason, message=message,
                    lock_token=None, lock_expires_at=None, updated_at=now,
                    not_before=now + timedelta(seconds=UNSCHEDULABLE_RETRY_SECONDS))
        )


def _bind(ctx: ServiceContext, job: LeasedJob, token: str, decision: GangDecision,
          nodes: dict[str, NodeModel], versions: dict[str, int]) -> bool:
    """Bind every member in one transaction; any stale guard rolls all of it back."""
    assert decision.placements is not None
    now = ctx.clock.now()
    chosen = [nodes[p.node] for p in decision.placements]
    addresses = [node.address or node.name for node in chosen]
    with ctx.db.transaction() as session:
        ok = _claim_job(session, job, token, now, decision.summary) and all(
            claim_node(session, node.id, versions[node.name])
            for node in sorted(chosen, key=lambda n: n.id)
        ) and all(
            _bind_member(session, job, rank, node, placement, addresses, now)
            for rank, (node, placement) in enumerate(zip(chosen, decision.placements,
                                                         strict=True))
        )
        if not ok:
            session.rollback()
            return False
    for node in chosen:
        versions[node.name] += 1
    return True


def _claim_job(session: Session, job: LeasedJob, token: str, now: datetime,
               where: str) -> bool:
    return bool(rows_changed(
        session,
        update(JobModel)
        .where(JobModel.id == job.id, JobModel.version == job.version,
               JobModel.lock_token == token, JobModel.gang_state == QUEUED,
               JobModel.deleted_at.is_(None), JobModel.desired_state == "running")
        .values(gang_state=STARTING, scheduled_at=now, barrier_released_at=None,
                unschedulable=None, reason="Scheduled", message=where, not_before=None,
                nominated_until=None, lock_token=None, lock_expires_at=None, updated_at=now,
                version=JobModel.version + 1),
    ))


def _bind_member(session: Session, job: LeasedJob, rank: int, node: NodeModel,
                 placement: Placement, addresses: list[str], now: datetime) -> bool:
    pod_id, version = job.members[rank]
    uuids = {g["index"]: g["uuid"] for g in node.gpus}
    milli = {str(i): m for i, m in sorted(placement.gpu_milli.items())}
    mig_slot = next((start for _, start in placement.mig.values()), None)
    env = {**job.env, **rendezvous_env(rank, addresses, job.gpus_per_node,
                                       master_port(job.id))}
    bound = rows_changed(
        session,
        update(PodModel)
        .where(PodModel.id == pod_id, PodModel.version == version,
               PodModel.phase == PodPhase.PENDING.value, PodModel.deleted_at.is_(None))
        .values(phase=PodPhase.SCHEDULED.value, node_id=node.id,
                gpu_uuids=[uuids[int(i)] for i in milli], gpu_milli=milli, env=env,
                mig_slot=mig_slot, mig_device=None,
                attempt=PodModel.attempt + 1, log_tail=None, reason="Scheduled",
                message=f"bound to {node.name} with the rest of its job", ready_at=None,
                unschedulable=None, nominated_node_id=None, nominated_gpu_milli=None,
                nominated_until=None, updated_at=now, version=PodModel.version + 1),
    )
    if bound:
        record_event(session, pod_id, now, "Scheduled", f"bound to {node.name} (gang)",
                     PodPhase.PENDING.value, PodPhase.SCHEDULED.value)
    return bool(bound)


def _mark_unschedulable(ctx: ServiceContext, job: LeasedJob, token: str,
                        decision: GangDecision) -> None:
    now = ctx.clock.now()
    reasons = dict(decision.explanation.reasons) if decision.explanation else {}
    with ctx.db.transaction() as session:
        session.execute(
            update(JobModel)
            .where(JobModel.id == job.id, JobModel.lock_token == token,
                   JobModel.version == job.version)
            .values(unschedulable=reasons, reason="Unschedulable", message=decision.summary,
                    lock_token=None, lock_expires_at=None, updated_at=now,
                    not_before=now + timedelta(seconds=UNSCHEDULABLE_RETRY_SECONDS))
        )


def _release_lock(ctx: ServiceContext, job: LeasedJob, token: str) -> None:
    with ctx.db.transaction() as session:
        session.execute(update(JobModel)
                        .where(JobModel.id == job.id, JobModel.lock_token == token)
                        .values(lock_token=None, lock_expires_at=None))


# -- the start barrier ----------------------------------------------------------------------


def report_ready(ctx: ServiceContext, node_id: str, pod_id: str,
                 request: AgentPodReadyRequest) -> None:
    """A member's container is created and waits at the barrier (fencing token checked)."""
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        node = session.get_one(NodeModel, node_id, with_for_update=True)
        check_fencing(node, request.fencing_token)
        pod = session.get(PodModel, pod_id, with_for_update=True)
        if pod is None or pod.job_id is None:
            raise NotFound(f"job member {pod_id!r} not found")
        if pod.node_id != node.id or request.attempt != pod.attempt:
            raise Conflict(f"pod {pod.name!r} attempt {request.attempt} is not bound to "
                           f"node {node.name!r}")
        if PodPhase(pod.phase) not in ACTIVE_PHASES:
            raise Conflict(f"pod {pod.name!r} is {pod.phase}; too late to be ready")
        if pod.ready_at is None:
            pod.ready_at = now
            pod.reason, pod.message = "Ready", "created; waiting for the rest of its job"
            pod.updated_at = now
            pod.version += 1
            record_event(session, pod.id, now, "Ready", "waiting at the start barrier")


# -- reconcile ------------------------------------------------------------------------------


#: Whether any job is queued or has bound members: the job pass's two looks (``reconcile``,
#: ``lease_queued``) find nothing to do otherwise. Built once: most clouds run pods, not
#: jobs, and every pass (each pod's create wakes one) asks.
_ANY_WORK = select(JobModel.id).where(
    JobModel.gang_state.in_([QUEUED, STARTING, RUNNING, STOPPING])).limit(1)


def has_work(ctx: ServiceContext) -> bool:
    """Whether ``reconcile`` or ``run_pass`` may have something to do (one read)."""
    with ctx.db.read() as session:
        return session.scalar(_ANY_WORK) is not None


def reconcile(ctx: ServiceContext) -> list[str]:
    """One look at every job with bound members; returns the ids of those it changed.
    The ids are only read (no write lock, no fence); each job is locked on its own."""
    with ctx.db.read() as session:
        ids = session.scalars(
            select(JobModel.id).where(JobModel.gang_state.in_([STARTING, RUNNING, STOPPING]))
            .order_by(JobModel.created_at)
        ).all()
    changed = []
    for job_id in ids:
        with ctx.db.transaction() as session:
            job = session.get_one(JobModel, job_id, with_for_update=True)
            before = (job.gang_state, job.phase, job.version)
            _reconcile_job(ctx, session, job, lock_members(session, job.id))
            if (job.gang_state, job.phase, job.version) != before:
                changed.append(job_id)
    return changed


def lock_members(session: Session, job_id: str) -> list[PodModel]:
    """The job's members by rank, their nodes and then themselves locked (PostgreSQL)."""
    node_ids = sorted({n for n in session.scalars(
        select(PodModel.node_id).where(PodModel.job_id == job_id)) if n})
    if node_ids:
        session.execute(select(NodeModel.id).where(NodeModel.id.in_(node_ids))
                        .order_by(NodeModel.id).with_for_update())
    return list(session.scalars(select(PodModel).where(PodModel.job_id == job_id)
                                .order_by(PodModel.rank).with_for_update()))


def _reconcile_job(ctx: ServiceContext, session: Session, job: JobModel,
                   members: list[PodModel]) -> None:
    now = ctx.clock.now()
    if job.gang_state == STOPPING:
        finish_teardown(ctx, session, job, members, now)
        return
    failure = _failure(members, job.gang_state)
    if failure is not None:
        # a spot gang that lost a node is requeued as after a preemption (no restart count)
        then = PREEMPT if job.spot and failure[0] == "NodeLost" else RESTART
        teardown(ctx, session, job, members, now, then, failure)
    elif job.gang_state == STARTING and all(_ready(m) for m in members):
        _release_barrier(session, job, members, now)
    elif job.gang_state == STARTING and job.scheduled_at is not None and now >= (
            job.scheduled_at + timedelta(seconds=job.ready_timeout_seconds)):
        ready = sum(_ready(m) for m in members)
        teardown(ctx, session, job, members, now, REQUEUE,
                 ("ReadyTimeout", f"{ready} of {len(members)} members ready after "
                                  f"{job.ready_timeout_seconds:g}s"))
    elif job.gang_state == RUNNING and all(m.phase == PodPhase.SUCCEEDED.value
                                           for m in members):
        _end(job, JobPhase.SUCCEEDED, now, "Completed", "every member succeeded")


def _ready(member: PodModel) -> bool:
    return member.ready_at is not None and PodPhase(member.phase) in ACTIVE_PHASES


def _failure(members: list[PodModel], state: str) -> tuple[str, str] | None:
    """(reason, message) of the first member (by rank) whose end fails the gang."""
    for member in members:
        phase = PodPhase(member.phase)
        if phase not in TERMINAL_PHASES:
            continue
        if phase is PodPhase.SUCCEEDED and state == RUNNING:
            continue
        reason = "NodeLost" if phase is PodPhase.LOST else "MemberFailed"
        detail = f"{member.reason}" + (f" (exit code {member.exit_code})"
                                       if member.exit_code is not None
                                       and "exit code" not in (member.reason or "") else "")
        return reason, f"member {member.rank} ({member.name}) {phase}: {detail}"
    return None


def _release_barrier(session: Session, job: JobModel, members: list[PodModel],
                     now: datetime) -> None:
    """Every member is ready: release all of them at once."""
    job.barrier_released_at = now
    job.gang_state = RUNNING
    job.phase = JobPhase.RUNNING.value
    job.reason, job.message = "Running", f"all {len(members)} members started together"
    job.started_at = job.started_at or now
    _touch(job, now)
    for member in members:
        bump_assignments(session, member.node_id)


def teardown(ctx: ServiceContext, session: Session, job: JobModel, members: list[PodModel],
             now: datetime, then: str, why: tuple[str, str]) -> None:
    """Stop every member that still runs; ``then`` says what follows once all have ended."""
    job.gang_state, job.teardown = STOPPING, then
    job.reason, job.message = why
    job.barrier_released_at = None
    if then != STOP:
        job.phase = JobPhase.PENDING.value
    _touch(job, now)
    for member in members:
        stop_member(session, member, now, f"job {job.name}: {why[1]}")
    finish_teardown(ctx, session, job, members, now)


def stop_member(session: Session, member: PodModel, now: datetime, why: str) -> None:
    """Ask the member's agent to stop it; a member not yet bound stops at once."""
    phase = PodPhase(member.phase)
    if phase is PodPhase.PENDING:
        transition(session, member, PodPhase.STOPPED, now, "GangStopped", why)
        member.desired_state = "stopped"
        member.finished_at = now
    elif phase in ACTIVE_PHASES and member.desired_state == "running":
        member.desired_state = "stopped"
        member.version += 1
        record_event(session, member.id, now, "StopRequested", why)
        bump_assignments(session, member.node_id)


def finish_teardown(ctx: ServiceContext, session: Session, job: JobModel,
                    members: list[PodModel], now: datetime) -> None:
    """Once no member runs: end the job, or requeue the whole gang with back-off."""
    if any(PodPhase(m.phase) in ACTIVE_PHASES for m in members):
        return
    if job.teardown == STOP or job.desired_state != "running":
        _end(job, JobPhase.STOPPED, now, job.reason or "Stopped", job.message)
    elif job.teardown == REQUEUE:
        job.ready_timeouts += 1
        _requeue(ctx, session, job, members, now, job.ready_timeouts)
    elif job.teardown == PREEMPT:
        _requeue(ctx, session, job, members, now, 0)
    elif job.restarts < job.max_restarts:
        job.restarts += 1
        _requeue(ctx, session, job, members, now, job.restarts)
    else:
        done = f"; restarted {job.restarts} time{'' if job.restarts == 1 else 's'} " \
               f"(max-restarts {job.max_restarts})"
        _end(job, JobPhase.FAILED, now, job.reason or "MemberFailed",
             (job.message or "") + done)


def _requeue(ctx: ServiceContext, session: Session, job: JobModel, members: list[PodModel],
             now: datetime, count: int) -> None:
    delay = min(ctx.settings.restart_backoff_seconds * 2 ** (count - 1),
                ctx.settings.restart_backoff_max_seconds) if count else 0.0
    for member in members:
        if PodPhase(member.phase) in TERMINAL_PHASES:
            node_id = member.node_id
            requeue(session, member, now, "GangRestarting", job.message)
            if job.teardown == PREEMPT:  # not straight back onto the node it lost
                spot.avoid(ctx, member, node_id, now)
        member.ready_at = None
    job.gang_state, job.teardown = QUEUED, None
    job.phase = JobPhase.PENDING.value
    job.message = f"{job.message}; back in the queue in {delay:g}s"
    job.not_before = now + timedelta(seconds=delay)
    job.scheduled_at = None
    _touch(job, now)


def _end(job: JobModel, phase: JobPhase, now: datetime, reason: str,
         message: str | None) -> None:
    job.phase = phase.value
    job.gang_state, job.teardown = ENDED, None
    job.reason, job.message = reason, message
    job.finished_at = now
    _touch(job, now)


def _touch(job: JobModel, now: datetime) -> None:
    job.updated_at = now
    job.version += 1
