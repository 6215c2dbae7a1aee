"""Node drain: empty a node for maintenance, moving its pods elsewhere with notice.

``gpucloud node drain NODE [--deadline 10m]`` cordons the node at once and records the
drain (state ``waiting``). The drain controller (``tick``) then:

1. starts waiting drains, oldest first, while fewer than ``max_draining_nodes`` drain:
   every pod bound there gets the preemption notice (reason ``drain``; the checkpoint
   request comes with it, see services/interval) and is stopped; a job's members are
   torn down as one gang and requeued whole; standalone pods are requeued once they
   have stopped (``spot.requeue_after_stop``) and placed on other nodes;
2. marks a draining node ``drained`` once no pod holds resources on it;
3. at the deadline, stops what is still bound there (its agent is told by the pod's
   absence from its assignments, and kills it) and requeues it.

``Draining`` and ``Drained`` are shown as the node's status (``nodes.display_status``);
the lease status (Ready/Lost) is kept apart, so a drained node is never taken for a lost
one. ``undrain`` ends a drain at any point and uncordons the node.

Lock order, on PostgreSQL, as elsewhere: job row, then nodes, then pods.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpucloud.core.errors import InvalidInput
from gpucloud.core.models import NodeOut
from gpucloud.core.phases import ACTIVE_PHASE_VALUES, ACTIVE_PHASES, PodPhase
from gpucloud.core.quantities import parse_duration
from gpucloud.core.spot import DrainState, NodeDrainRequest, StopReason
from gpucloud.db.models import JobModel, NodeModel, PodModel
from gpucloud.services import gangs, spot
from gpucloud.services.context import ServiceContext
from gpucloud.services.events import transition
from gpucloud.services.nodes import _allocated_gpus, _find_node, node_out
from gpucloud.services.pods import bump_assignments, complete_restart, requeue
from gpucloud.services.projects import Principal
from gpucloud.services.scheduling import retry_unschedulable

MAX_DEADLINE_SECONDS = 7 * 86400.0
DEADLINE_PASSED = "drain deadline passed"


def deadline_seconds(ctx: ServiceContext, request: NodeDrainRequest) -> float:
    """The drain's deadline in seconds (``60s``, ``10m``; default from the settings)."""
    if request.deadline is None:
        return ctx.settings.drain_deadline_seconds
    seconds = parse_duration("deadline", request.deadline)
    if not 0 < seconds <= MAX_DEADLINE_SECONDS:
        raise InvalidInput("deadline", "must be more than 0 and at most 7 days")
    return seconds


def drain_node(ctx: ServiceContext, caller: Principal, ref: str,
               request: NodeDrainRequest) -> NodeOut:
    """Cordon the node and record the drain; the first controller step starts it (run
    here once, so that the answer already says whether it started)."""
    caller.require_admin()
    seconds = deadline_seconds(ctx, request)
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        node = _find_node(session, ref)
        if node.drain_state in (DrainState.WAITING.value, DrainState.DRAINING.value):
            node.drain_deadline_seconds = seconds  # asked again: the new deadline holds
        else:
            node.drain_state, node.drain_requested_at = DrainState.WAITING.value, now
            node.drain_started_at = node.drain_finished_at = None
            node.drain_deadline_seconds, node.drain_pods_total = seconds, 0
        node.cordoned = True
        node.version += 1
        node_id = node.id
    tick(ctx)
    return _out(ctx, node_id)


def undrain_node(ctx: ServiceContext, caller: Principal, ref: str) -> NodeOut:
    """End the node's drain (pods already noticed still move) and uncordon it."""
    caller.require_admin()
    with ctx.db.transaction() as session:
        node = _find_node(session, ref)
        node.drain_state = node.drain_requested_at = node.drain_started_at = None
        node.drain_deadline_seconds = node.drain_finished_at = None
        node.drain_pods_total = 0
        node.cordoned = False
        node.version += 1
        retry_unschedulable(session)
        node_id = node.id
    return _out(ctx, node_id)


def _out(ctx: ServiceContext, node_id: str) -> NodeOut:
    with ctx.db.read() as session:
        node = session.get_one(NodeModel, node_id)
        return node_out(session, node, _allocated_gpus(session).get(node_id, 0))


# -- the controller's step --------------------------------------------------------------------


def tick(ctx: ServiceContext) -> list[str]:
    """One step of every drain (draining ones first, so a drain that ends makes room for
    a waiting one at once); returns the names of the nodes whose drain state changed."""
    changed: list[str] = []
    now = ctx.clock.now()
    with ctx.db.read() as session:
        drains = session.connection().execute(_DRAINS).all()
    for node_id, name, state, started, seconds in drains:
        if state != DrainState.DRAINING.value:
            continue
        if started is not None and seconds is not None and (
                now >= started + timedelta(seconds=seconds)):
            _stop_what_is_left(ctx, node_id, name)
        if _finish_if_empty(ctx, node_id):
            changed.append(name)
    waiting = any(state == DrainState.WAITING.value for _, _, state, _, _ in drains)
    return changed + (_start_waiting(ctx) if waiting else [])


#: The nodes draining or waiting to, built once: every controller pass reads it, and most
#: find none (one query then, not three).
_DRAINS = (select(NodeModel.id, NodeModel.name, NodeModel.drain_state,
                  NodeModel.drain_started_at, NodeModel.drain_deadline_seconds)
           .where(NodeModel.drain_state.in_([DrainState.DRAINING.value,
                                             DrainState.WAITING.value])))


def _start_waiting(ctx: ServiceContext) -> list[str]:
    """Start the oldest waiting drains while fewer than the limit are draining."""
    with ctx.db.read() as session:
        running = session.scalar(select(func.count()).select_from(NodeModel).where(
            NodeModel.drain_state == DrainState.DRAINING.value)) or 0
        free = max(0, ctx.settings.max_draining_nodes - running)
        waiting = session.execute(
            select(NodeModel.id, NodeModel.name, NodeModel.version)
            .where(NodeModel.drain_state == DrainState.WAITING.value)
            .order_by(NodeModel.drain_requested_at, NodeModel.name).limit(free)).all()
    started = []
    for node_id, name, version in waiting:
        if _mark_started(ctx, node_id, version):
            _notice_pods(ctx, node_id, name)
            started.append(name)
    return started


def _mark_started(ctx: ServiceContext, node_id: str, version: int) -> bool:
    """Guarded: a drain undone or restarted meanwhile is left alone."""
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        node = session.get_one(NodeModel, node_id, with_for_update=True)
        if node.version != version or node.drain_state != DrainState.WAITING.value:
            return False
        node.drain_state, node.drain_started_at = DrainState.DRAINING.value, now
        node.drain_pods_total = len(_active(session, node_id))
        node.version += 1
        return True


def _active(session: Session, node_id: str) -> list[PodModel]:
    return list(session.scalars(
        select(PodModel).where(PodModel.node_id == node_id,
                               PodModel.phase.in_(ACTIVE_PHASE_VALUES))
        .order_by(PodModel.id)))


def _notice_pods(ctx: ServiceContext, node_id: str, name: str) -> None:
    """Notice every pod on the node: each gang whole, each standalone pod alone (each in
    its own transaction, in the lock order)."""
    why = f"node {name} is draining"
    with ctx.db.read() as session:
        units = session.execute(
            select(PodModel.id, PodModel.job_id).where(
                PodModel.node_id == node_id, PodModel.phase.in_(ACTIVE_PHASE_VALUES),
                PodModel.desired_state == "running", PodModel.deleted_at.is_(None))).all()
    for job_id in sorted({job for _, job in units if job}):
        with ctx.db.transaction() as session:
            _notice_gang(ctx, session, job_id, why)
    for pod_id in sorted(pod for pod, job in units if job is None):
        with ctx.db.transaction() as session:
            _notice_pod(ctx, session, node_id, pod_id, why)


def _notice_gang(ctx: ServiceContext, session: Session, job_id: str, why: str) -> None:
    now = ctx.clock.now()
    job = session.get_one(JobModel, job_id, with_for_update=True)
    if job.gang_state not in {gangs.STARTING, gangs.RUNNING} or job.desired_state != "running":
        return
    members = gangs.lock_members(session, job.id)
    for member in members:  # every member at once, wherever it runs
        if PodPhase(member.phase) in ACTIVE_PHASES and member.desired_state == "running":
            spot.give_notice(ctx, session, member, StopReason.DRAIN, why, now)
    gangs.teardown(ctx, session, job, members, now, gangs.PREEMPT, (spot.PREEMPTED, why))


def _notice_pod(ctx: ServiceContext, session: Session, node_id: str, pod_id: str,
                why: str) -> None:
    now = ctx.clock.now()
    session.execute(select(NodeModel.id).where(NodeModel.id == node_id).with_for_update())
    pod = session.get_one(PodModel, pod_id, with_for_update=True, populate_existing=True)
    if pod.node_id != node_id or PodPhase(pod.phase) not in ACTIVE_PHASES or (
            pod.desired_state != "running" or pod.deleted_at is not None):
        return
    pod.desired_state, pod.reason, pod.message = "stopped", spot.PREEMPTED, why
    pod.updated_at = now
    pod.version += 1
    spot.give_notice(ctx, session, pod, StopReason.DRAIN, why, now)
    bump_assignments(session, node_id)


def _stop_what_is_left(ctx: ServiceContext, node_id: str, name: str) -> None:
    """At the deadline: what still holds resources on the node is stopped here and
    requeued (a standalone pod) or left to its gang's teardown (a job's member)."""
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        session.execute(select(NodeModel.id).where(NodeModel.id == node_id).with_for_update())
        left = _active(session, node_id)
        for pod in left:
            wanted = pod.desired_state == "running" or spot.notice_of(pod) is not None
            transition(session, pod, PodPhase.STOPPED, now, spot.PREEMPTED,
                       f"node {name}: {DEADLINE_PASSED}")
            pod.finished_at = now
            if pod.job_id is None and pod.deleted_at is None and (
                    not complete_restart(session, pod, now) and wanted):
                requeue(session, pod, now, "Requeued", f"node {name} was drained")
                spot.avoid(ctx, pod, node_id, now)
        if left:
            bump_assignments(session, node_id)
            retry_unschedulable(session)


def _finish_if_empty(ctx: ServiceContext, node_id: str) -> bool:
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        node = session.get_one(NodeModel, node_id, with_for_update=True)
        if node.drain_state != DrainState.DRAINING.value or _active(session, node_id):
            return False
        node.drain_state, node.drain_finished_at = DrainState.DRAINED.value, now
        node.version += 1
        return True
