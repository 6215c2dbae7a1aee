"""Preemption, the control plane's side: what runs, stopping victims, reservations.

The scheduling passes (``scheduling`` for pods, ``gangs`` for jobs) ask the pure planner
(``scheduler.preemption``) for victims when high-priority work fits nowhere, then apply the
plan here in ONE transaction: every victim is asked to stop (``desired_state=stopped``;
its grace period applies; a victim gang is torn down whole and requeued) and the
preemptor gets a reservation (``nominated_*``) of the capacity freed for it. Any stale
guard (a victim that ended or changed, the preemptor stopped or re-leased) rolls all of it
back. The passes count live reservations as taken for everyone else, and bind the
preemptor onto its reservation once the victims are gone.

Lock order, on PostgreSQL, as elsewhere: victim job rows, then nodes, then pods.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from gpucloud.core.jobs import Topology
from gpucloud.core.phases import ACTIVE_PHASE_VALUES, ACTIVE_PHASES, PodPhase
from gpucloud.db.models import JobModel, NodeModel, PodModel
from gpucloud.db.session import rows_changed
from gpucloud.scheduler import NodeState, Placement, PodRequest, Scheduler
from gpucloud.scheduler.preemption import (
    Member,
    PreemptionPlan,
    Preemptor,
    Running,
    gpu_models,
    plan_preemption,
    with_placements,
    without_victims,
)
from gpucloud.scheduler.quota import Ledger, gpu_capacity
from gpucloud.services import backfill, gangs, quotas, scheduling, spot
from gpucloud.services.context import ServiceContext
from gpucloud.services.events import record_event
from gpucloud.services.pods import bump_assignments
from gpucloud.services.scheduling import Snapshot

#: Preemption attempts per pass: each is a planner run over the cluster.
MAX_PREEMPTIONS_PER_PASS = 4
PREEMPTED = "Preempted"
PREEMPTING = "Preempting"


@dataclass(frozen=True)
class RunningWork:
    """The running units, and each pod unit's version (the guard of its stop)."""

    units: list[Running]
    pod_versions: dict[str, int]


@dataclass(frozen=True)
class Reservation:
    """A preemptor's part of a plan: member pod id -> (node id, GPU index -> milli)."""

    members: dict[str, tuple[str, dict[str, int]]]


def running_work(ctx: ServiceContext, node_names: dict[str, str]) -> RunningWork:
    """Active pods not already stopping, as units: standalone pods, and job members
    grouped by job (a gang is preempted whole)."""
    with ctx.db.read() as session:
        rows = session.execute(
            select(PodModel.id, PodModel.version, PodModel.project_id, PodModel.priority,
                   PodModel.job_id, PodModel.node_id, PodModel.gpu_milli, PodModel.cpu_milli,
                   PodModel.memory_bytes, PodModel.started_at, PodModel.updated_at,
                   PodModel.mig_profile, PodModel.mig_slot, PodModel.gpu_memory_bytes)
            .where(PodModel.phase.in_(ACTIVE_PHASE_VALUES), PodModel.node_id.is_not(None),
                   PodModel.desired_state == "running", PodModel.deleted_at.is_(None))
        ).all()
    versions: dict[str, int] = {}
    grouped: dict[str, list[tuple[Member, int, str, datetime]]] = defaultdict(list)
    for (pod_id, version, project, priority, job_id, node_id, gpu_milli, cpu, memory,
         started, updated, mig_profile, mig_slot, gpu_memory) in rows:
        milli = {int(i): m for i, m in gpu_milli.items()}
        mig = ({i: (mig_profile, mig_slot) for i in milli}
               if mig_profile is not None and mig_slot is not None else {})
        member = Member(node_names.get(node_id or "", ""), milli, cpu, memory, mig,
                        _mib(gpu_memory))
        grouped[job_id or pod_id].append((member, priority, project, started or updated))
        if job_id is None:
            versions[pod_id] = version
    units = [Running(key, max(p for _, p, _, _ in parts), parts[0][2],
                     min(s for _, _, _, s in parts).timestamp(),
                     tuple(m for m, _, _, _ in parts))
             for key, parts in grouped.items()]
    return RunningWork(units, versions)


def apply_plan(ctx: ServiceContext, session: Session, plan: PreemptionPlan,
               work: RunningWork, preemptor: str, now: datetime) -> bool:
    """Ask every victim to stop, naming the preemptor; False if any of them changed."""
    jobs = sorted(v.key for v in plan.victims if v.key not in work.pod_versions)
    pods = sorted(v.key for v in plan.victims if v.key in work.pod_versions)
    locked = {job.id: job for job in session.scalars(
        select(JobModel).where(JobModel.id.in_(jobs)).order_by(JobModel.id).with_for_update())}
    node_ids = sorted({n for n in session.scalars(select(PodModel.node_id).where(
        PodModel.id.in_(pods) | PodModel.job_id.in_(jobs))) if n})
    session.execute(select(NodeModel.id).where(NodeModel.id.in_(node_ids))
                    .order_by(NodeModel.id).with_for_update())
    return all(_stop_gang(ctx, session, locked.get(job_id), _why(plan, job_id, preemptor), now)
               for job_id in jobs) and all(
        _stop_pod(ctx, session, pod_id, work.pod_versions[pod_id],
                  _why(plan, pod_id, preemptor), now) for pod_id in pods)


def _why(plan: PreemptionPlan, victim: str, preemptor: str) -> str:
    """``preempted by job train``, or for reclaim ``... to reclaim its project's quota``."""
    why = f"preempted by {preemptor}"
    return f"{why} to reclaim its project's quota" if victim in plan.reclaimed else why


def _stop_pod(ctx: ServiceContext, session: Session, pod_id: str, version: int, why: str,
              now: datetime) -> bool:
    values: dict[str, object] = {"desired_state": "stopped", "reason": PREEMPTED,
                                 "message": why, "updated_at": now,
                                 "version": PodModel.version + 1}
    stopped = rows_changed(session, update(PodModel).where(
        PodModel.id == pod_id, PodModel.version == version, PodModel.phase.in_(ACTIVE_PHASE_VALUES),
        PodModel.desired_state == "running", PodModel.deleted_at.is_(None)).values(**values))
    if not stopped:
        return False
    pod = session.get_one(PodModel, pod_id, populate_existing=True)
    spot.give_notice(ctx, session, pod, spot.reason_for(pod), why, now)
    bump_assignments(session, pod.node_id)
    return True


def _stop_gang(ctx: ServiceContext, session: Session, job: JobModel | None, why: str,
               now: datetime) -> bool:
    """Tear a victim job down whole; it is requeued once every member has stopped."""
    if job is None or job.gang_state not in {gangs.STARTING, gangs.RUNNING} or (
            job.desired_state != "running"):
        return False
    members = gangs.lock_members(session, job.id)
    for member in members:  # every member is noticed at once
        if PodPhase(member.phase) in ACTIVE_PHASES:
            spot.give_notice(ctx, session, member, spot.reason_for(member), why, now)
    gangs.teardown(ctx, session, job, members, now, gangs.PREEMPT, (PREEMPTED, why))
    return True


def reserve(session: Session, reservation: Reservation, until: datetime) -> None:
    """Hold the freed capacity for the preemptor's pods (the caller claimed them)."""
    for pod_id, (node_id, gpu_milli) in reservation.members.items():
        session.execute(update(PodModel).where(PodModel.id == pod_id).values(
            nominated_node_id=node_id, nominated_gpu_milli=gpu_milli, nominated_until=until))


def reservation_until(ctx: ServiceContext, now: datetime) -> datetime:
    return now + timedelta(seconds=ctx.settings.preemption_reservation_seconds)


def victims_summary(plan: PreemptionPlan) -> str:
    """``preempting 2 pods of lower priority and 1 pod running on borrowed quota on a, b;
    waiting for them to stop``."""
    nodes = sorted({m.node for v in plan.victims for m in v.members})
    count = plan.victim_pods
    reclaimed = sum(len(v.members) for v in plan.victims if v.key in plan.reclaimed)
    kinds = [f"{n} pod{'' if n == 1 else 's'} {what}"
             for n, what in ((count - reclaimed, "of lower priority"),
                             (reclaimed, "running on borrowed quota")) if n]
    return (f"preempting {' and '.join(kinds)} on {', '.join(nodes)}; "
            f"waiting for {'it' if count == 1 else 'them'} to stop")


# -- the preemption passes -------------------------------------------------------------------


@dataclass
class _Cluster:
    """What one preemption pass plans against, updated after each applied plan."""

    snap: Snapshot
    nodes: list[NodeState]
    work: RunningWork
    ledger: Ledger
    ids: dict[str, str]  # node name -> id
    held: backfill.GangReservation | None
    models: dict[tuple[str, int], str]  # (node name, GPU index) -> model

    def nodes_for(self, key: str, priority: int, max_duration: float | None,
                  now: datetime) -> list[NodeState]:
        """What the preemptor ``key`` may plan on: the blocked head gang's reserved nodes
        are closed to work the gang is not outranked by, unless it ends in time — as in
        the scheduling passes, so preemption never takes a backfill reservation either."""
        held = self.held
        if held is None or held.job_id == key or not held.closes(priority, max_duration, now):
            return self.nodes
        return backfill.restricted(self.nodes, held)

    def applied(self, plan: PreemptionPlan, requests: Sequence[PodRequest],
                project: str) -> None:
        """The plan's victims gone and its preemptor (of ``project``) placed."""
        gone = {v.key for v in plan.victims}
        for unit in plan.victims:
            for member in unit.members:
                for index, milli in member.gpu_milli.items():
                    self.ledger.remove(unit.project, self.models.get((member.node, index), ""),
                                       milli)
        for placement in plan.placements:
            for index, milli in placement.gpu_milli.items():
                self.ledger.add(project, self.models.get((placement.node, index), ""), milli)
        self.nodes = with_placements(without_victims(self.nodes, plan.victims), requests,
                                     plan.placements)
        self.work = RunningWork([u for u in self.work.units if u.key not in gone],
                                self.work.pod_versions)


def _cluster(ctx: ServiceContext) -> _Cluster:
    snap = scheduling.snapshot(ctx)
    names = {node.id: name for name, node in snap.by_name.items()}
    with ctx.db.transaction() as session:
        ledger = quotas.load_ledger(session, ctx.clock.now())
    return _Cluster(snap, snap.nodes, running_work(ctx, names), ledger,
                    {name: node.id for name, node in snap.by_name.items()},
                    backfill.head_reservation(ctx, snap.nodes), gpu_models(snap.nodes))


@dataclass(frozen=True)
class _Standing:
    """Where a preemptor stands against its project's quota."""

    borrowing: bool
    reclaiming: bool


def _standing(cluster: _Cluster, project: str, gpu_type: str | None, milli: int) -> _Standing:
    """Borrowing: it would run beyond its quota. Reclaiming: it asks for GPUs and stays
    within its quota, so it may take others' borrowed work back."""
    model = scheduling.quota_model(cluster.ledger, project, gpu_type, milli,
                                   gpu_capacity(cluster.nodes))
    if model is None:
        return _Standing(False, False)
    borrowing = cluster.ledger.would_borrow(project, model, milli)
    return _Standing(borrowing, milli > 0 and not borrowing)


def preempt_for_pods(ctx: ServiceContext, scheduler: Scheduler,
                     pod_ids: Sequence[str]) -> list[str]:
    """Make room for unschedulable pods by preempting lower-priority work; returns the
    pods that now hold a reservation."""
    with ctx.db.transaction() as session:
        pods = session.scalars(
            select(PodModel).where(PodModel.id.in_(pod_ids),
                                   PodModel.phase == PodPhase.PENDING.value,
                                   PodModel.reason == "Unschedulable",
                                   # pinned to its volume's node: it waits for room there
                                   PodModel.volume_node_id.is_(None))
            .order_by(PodModel.priority.desc(), PodModel.created_at)
            .limit(MAX_PREEMPTIONS_PER_PASS)).all()
        session.expunge_all()
    if not pods:
        return []
    cluster = _cluster(ctx)
    done = []
    for pod in pods:
        request = _pod_request(pod)
        standing = _standing(cluster, pod.project_id, pod.gpu_type, round(pod.gpus * 1000))
        preemptor = Preemptor(pod.id, pod.priority, pod.project_id, (request,),
                              borrowing=standing.borrowing, reclaiming=standing.reclaiming)
        now = ctx.clock.now()
        nodes = cluster.nodes_for(pod.id, pod.priority, pod.max_duration_seconds, now)
        plan = plan_preemption(scheduler, nodes, cluster.work.units, preemptor,
                               cluster.ledger, now.timestamp())
        if plan is not None and _apply_for_pod(ctx, pod, plan, cluster):
            cluster.applied(plan, [request], pod.project_id)
            done.append(pod.id)
    return done


def _pod_request(pod: PodModel) -> PodRequest:
    """What the preemptor asks for, as the scheduling pass maps it: a MIG profile is a
    MIG slice (not whole GPUs), a share's memory limit must be left on its GPU."""
    whole = int(pod.gpus) if pod.gpus >= 1 and pod.mig_profile is None else 0
    share = round(pod.gpus * 1000) if 0 < pod.gpus < 1 else 0
    return PodRequest(key=pod.id, gpus=whole, gpu_milli=share, gpu_model=pod.gpu_type,
                      mig_profile=pod.mig_profile, gpu_memory_mib=_mib(pod.gpu_memory_bytes),
                      cpu_milli=pod.cpu_milli, memory_bytes=pod.memory_bytes)


def _mib(memory: int | None) -> int:
    """A device memory limit in whole MiB, rounded up (as the scheduling pass counts it)."""
    return -(-(memory or 0) // (1024 * 1024))


def _apply_for_pod(ctx: ServiceContext, pod: PodModel, plan: PreemptionPlan,
                   cluster: _Cluster) -> bool:
    now = ctx.clock.now()
    summary = victims_summary(plan)
    with ctx.db.transaction() as session:
        claimed = rows_changed(session, update(PodModel).where(
            PodModel.id == pod.id, PodModel.version == pod.version,
            PodModel.phase == PodPhase.PENDING.value, PodModel.desired_state == "running",
            PodModel.deleted_at.is_(None),
        ).values(reason=PREEMPTING, message=summary, unschedulable=None, not_before=None,
                 updated_at=now, version=PodModel.version + 1))
        if not claimed or not apply_plan(ctx, session, plan, cluster.work,
                                         f"pod {pod.name}", now):
            session.rollback()
            return False
        placement = plan.placements[0]
        reserve(session, Reservation({pod.id: (cluster.ids[placement.node], _milli(placement))}),
                reservation_until(ctx, now))
        if placement.mig:  # the slot the victims free: the bind onto the reservation uses it
            session.execute(update(PodModel).where(PodModel.id == pod.id).values(
                mig_slot=next(slot for _, slot in placement.mig.values())))
        record_event(session, pod.id, now, PREEMPTING, summary)
    return True


def _milli(placement: Placement) -> dict[str, int]:
    return {str(i): m for i, m in sorted(placement.gpu_milli.items())}


def preempt_for_jobs(ctx: ServiceContext, scheduler: Scheduler,
                     job_ids: Sequence[str]) -> list[str]:
    """Make room for unschedulable jobs, each gang whole; returns the jobs that now hold
    reservations."""
    with ctx.db.transaction() as session:
        jobs = session.scalars(
            select(JobModel).where(JobModel.id.in_(job_ids), JobModel.gang_state == gangs.QUEUED,
                                   JobModel.reason == "Unschedulable")
            .order_by(JobModel.priority.desc(), JobModel.created_at)
            .limit(MAX_PREEMPTIONS_PER_PASS)).all()
        session.expunge_all()
    if not jobs:
        return []
    cluster = _cluster(ctx)
    done = []
    for job in jobs:
        with ctx.db.transaction() as session:
            leased = gangs.leased_job(session, job)
        requests = gangs.member_requests(leased)
        milli = job.num_nodes * job.gpus_per_node * 1000
        standing = _standing(cluster, job.project_id, job.gpu_type, milli)
        preemptor = Preemptor(job.id, job.priority, job.project_id, tuple(requests),
                              Topology(job.topology), standing.borrowing, standing.reclaiming)
        now = ctx.clock.now()
        nodes = cluster.nodes_for(job.id, job.priority, job.max_duration_seconds, now)
        plan = plan_preemption(scheduler, nodes, cluster.work.units, preemptor,
                               cluster.ledger, now.timestamp())
        if plan is not None and _apply_for_job(ctx, leased, job, plan, cluster):
            cluster.applied(plan, requests, job.project_id)
            done.append(job.id)
    return done


def _apply_for_job(ctx: ServiceContext, leased: gangs.LeasedJob, job: JobModel,
                   plan: PreemptionPlan, cluster: _Cluster) -> bool:
    now = ctx.clock.now()
    summary = victims_summary(plan)
    until = reservation_until(ctx, now)
    with ctx.db.transaction() as session:
        claimed = rows_changed(session, update(JobModel).where(
            JobModel.id == job.id, JobModel.version == job.version,
            JobModel.gang_state == gangs.QUEUED, JobModel.desired_state == "running",
            JobModel.deleted_at.is_(None),
        ).values(reason=PREEMPTING, message=summary, unschedulable=None, not_before=None,
                 nominated_until=until, updated_at=now, version=JobModel.version + 1))
        if not claimed or not apply_plan(ctx, session, plan, cluster.work,
                                         f"job {job.name}", now):
            session.rollback()
            return False
        reserve(session, Reservation({
            pod_id: (cluster.ids[p.node], _milli(p))
            for (pod_id, _), p in zip(leased.members, plan.placements, strict=True)}), until)
    return True
