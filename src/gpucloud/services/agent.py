"""What node agents write and read: assignments, pod status, log chunks.

Every write carries the node's fencing token; a stale one is refused (409) before anything
changes, so an agent that lost its lease cannot overwrite what a newer grant decided.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from gpucloud.core.errors import Conflict, NotFound
from gpucloud.core.models import (
    AgentLogChunkRequest,
    AgentPodStatusRequest,
    AssignmentOut,
    AssignmentsOut,
)
from gpucloud.core.phases import (
    ACTIVE_PHASE_VALUES,
    ACTIVE_PHASES,
    TERMINAL_PHASES,
    PodPhase,
    RestartPolicy,
    should_restart,
)
from gpucloud.db.models import JobModel, NodeModel, PodLogChunkModel, PodModel, ProjectModel
from gpucloud.services import (
    checkpoint_index,
    gpu_maintenance,
    interval,
    mig,
    migration,
    spot,
    volumes,
)
from gpucloud.services.context import ServiceContext
from gpucloud.services.events import record_event, transition
from gpucloud.services.fencing import check_fencing
from gpucloud.services.pods import bump_assignments, requeue
from gpucloud.services.scheduling import retry_unschedulable
from gpucloud.services.spec import pull_credentials
from gpucloud.services.ssh_keys import public_keys

#: Stops the server decided: the pod keeps this reason, not the agent's "Stopped".
_SERVER_STOPS = {"Preempted", "MaxDurationExceeded"}


def assignments_revision(ctx: ServiceContext, node_id: str) -> int:
    with ctx.db.read() as session:
        return session.get_one(NodeModel, node_id).assignments_revision


def assignments(ctx: ServiceContext, node_id: str) -> AssignmentsOut:
    """The pods the node must run (or stop): live pods bound to it in an active phase."""
    with ctx.db.read() as session:
        node = session.get_one(NodeModel, node_id)
        rows = session.execute(
            select(PodModel, ProjectModel.name, JobModel.barrier_released_at)
            .join(ProjectModel, ProjectModel.id == PodModel.project_id)
            .outerjoin(JobModel, JobModel.id == PodModel.job_id)
            .where(PodModel.node_id == node_id, PodModel.phase.in_(ACTIVE_PHASE_VALUES),
                   PodModel.deleted_at.is_(None))
            .order_by(PodModel.created_at)
        ).all()
        keys = public_keys(session, {pod.project_id for pod, _, _ in rows})
        pods = [_with_public_key(_assignment(pod, project, released is not None),
                                 keys.get(pod.project_id))
                for pod, project, released in rows]
        for (pod, _, _), assignment in zip(rows, pods, strict=True):
            _add_volumes(ctx, session, node, pod, assignment)
            _add_pull_credentials(session, pod, assignment)
            checkpoint_index.add_to_assignment(session, pod, assignment)
            interval.add_to_assignment(ctx, session, pod, assignment)
            assignment.mig_policy = mig.mig_policy(node)
        return AssignmentsOut(revision=node.assignments_revision,
                              fencing_token=node.fencing_token, pods=pods,
                              volume_pods=_volume_pods(session, node_id),
                              volume_exports=migration.exports(session, node_id),
                              gpu_actions=gpu_maintenance.pending(
                                  node, gpu_maintenance.busy_gpus(session, node_id)))


def _add_volumes(ctx: ServiceContext, session: Session, node: NodeModel, pod: PodModel,
                 assignment: AssignmentOut) -> None:
    """The pod's volume disk, container disk and network volumes, as this node mounts them."""
    assignment.volume_bytes = pod.volume_bytes
    assignment.volume_path = pod.volume_path
    assignment.container_disk_bytes = pod.container_disk_bytes
    assignment.volume_source = migration.volume_source(session, pod, node)
    assignment.network_volumes = volumes.mounts_for_node(
        ctx, session, pod.project_id, pod.network_volumes, node.volume_mode)


def _volume_pods(session: Session, node_id: str) -> list[str]:
    """Live pods whose volume disk lives on this node: the agent keeps only their dirs."""
    return list(session.scalars(
        select(PodModel.id).where(
            PodModel.deleted_at.is_(None), PodModel.volume_bytes.is_not(None),
            or_(PodModel.volume_node_id == node_id, PodModel.node_id == node_id,
                PodModel.volume_source_node_id == node_id))
        .order_by(PodModel.id)))


def _with_public_key(assignment: AssignmentOut, keys: str | None) -> AssignmentOut:
    """RunPod's ``PUBLIC_KEY``: the project's SSH keys, unless the pod sets its own."""
    if keys and "PUBLIC_KEY" not in assignment.env:
        assignment.env = {"PUBLIC_KEY": keys, **assignment.env}
    return assignment


def _add_pull_credentials(session: Session, pod: PodModel, assignment: AssignmentOut) -> None:
    """The registry login the pod's image is pulled with, when it names one (for its
    image's registry only)."""
    credentials = pull_credentials(session, pod, pod.project_id)
    if credentials is not None:
        assignment.registry_username, assignment.registry_password = credentials


def _assignment(pod: PodModel, project: str, barrier_released: bool) -> AssignmentOut:
    """A job's members share the host network and wait at the start barrier."""
    member = pod.job_id is not None
    return AssignmentOut(
        pod_id=pod.id, name=pod.name, project=project, attempt=pod.attempt,
        desired_state=pod.desired_state, phase=PodPhase(pod.phase), image=pod.image,
        command=pod.command, env=pod.env, ports=pod.ports, cpu_milli=pod.cpu_milli,
        memory_bytes=pod.memory_bytes, gpu_uuids=pod.gpu_uuids,
        gpu_milli=round(pod.gpus * 1000) if 0 < pod.gpus < 1 else 0,
        gpu_memory_bytes=pod.gpu_memory_bytes,
        stop_grace_seconds=pod.stop_grace_seconds, host_network=member, barrier=member,
        barrier_released=member and barrier_released, entrypoint=pod.entrypoint,
        stop_notice=spot.notice_of(pod), mig_profile=pod.mig_profile, mig_slot=pod.mig_slot,
    )


def _bound_pod(session: Session, node: NodeModel, pod_id: str) -> PodModel:
    pod = session.get(PodModel, pod_id)
    if pod is None:
        raise NotFound(f"pod {pod_id!r} not found")
    if pod.node_id != node.id:
        raise Conflict(f"pod {pod_id!r} is not bound to node {node.name!r}")
    return pod


def report_status(ctx: ServiceContext, node_id: str, pod_id: str,
                  report: AgentPodStatusRequest) -> PodPhase:
    """Apply an agent's report of a pod's phase; returns the pod's phase afterwards."""
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        node = session.get_one(NodeModel, node_id, with_for_update=True)
        check_fencing(node, report.fencing_token)
        pod = _bound_pod(session, node, pod_id)
        if report.attempt is not None and report.attempt != pod.attempt:
            raise Conflict(f"report for attempt {report.attempt}; the pod is on {pod.attempt}")
        current = PodPhase(pod.phase)
        if _already_applied(current, report.phase):
            return current  # a duplicate or a late report of a step already taken
        if report.phase is not current and current not in ACTIVE_PHASES:
            raise Conflict(f"pod {pod.name!r} is {current}; the agent's report is too late")
        _apply_details(session, node, pod, report, now)
        if report.phase is current:
            _update_reason(session, pod, report, now)
            return current
        _apply_phase(ctx, session, pod, report, now)
        return PodPhase(pod.phase)


#: The order an attempt's active phases are reached in (the agent reports them forward).
_FORWARD = (PodPhase.SCHEDULED, PodPhase.PULLING, PodPhase.RUNNING)


def _already_applied(current: PodPhase, reported: PodPhase) -> bool:
    """Whether a report is one the pod is already at or past within its attempt: a
    terminal phase reported again (a retry whose answer was lost), or an active phase
    behind the pod's (``Pulling`` arriving after ``Running``). Such a report changes
    nothing and is acknowledged, so a duplicated or reordered message never moves a pod
    backwards nor applies twice (a second ``Stopped`` must not overwrite the stop's reason,
    exit code or time). A pod restarted since is no longer bound to the attempt: the
    caller's node and attempt checks refuse those (409)."""
    if current in TERMINAL_PHASES:
        return reported is current
    return (current in _FORWARD and reported in _FORWARD
            and _FORWARD.index(reported) < _FORWARD.index(current))


def _apply_details(session: Session, node: NodeModel, pod: PodModel,
                   report: AgentPodStatusRequest, now: datetime) -> None:
    """What a report carries besides its phase: log tail, address, volume migration, MIG
    device."""
    if report.log_tail is not None:
        pod.log_tail = report.log_tail
    if report.network is not None:
        pod.network = report.network.model_dump()
    if report.volume_migration is not None:
        migration.apply_report(session, pod, node, report.volume_migration, now)
    mig.record_device(pod, report.phase, report.mig_device)


def _update_reason(session: Session, pod: PodModel, report: AgentPodStatusRequest,
                   now: datetime) -> None:
    if report.reason and (report.reason, report.message) != (pod.reason, pod.message):
        pod.reason, pod.message, pod.updated_at = report.reason, report.message, now
        # A same-phase report with news (e.g. a lazy pull's LazyPullFallback): an event.
        record_event(session, pod.id, now, report.reason, report.message)


def _apply_phase(ctx: ServiceContext, session: Session, pod: PodModel,
                 report: AgentPodStatusRequest, now: datetime) -> None:
    target = report.phase
    reason = report.reason or _default_reason(target, report.exit_code)
    message = report.message
    if target is PodPhase.STOPPED and pod.reason in _SERVER_STOPS:
        reason, message = pod.reason, pod.message  # the stop's cause, not its mechanics
    transition(session, pod, target, now, reason, message)
    if target is PodPhase.RUNNING:
        pod.started_at = now
    if target in TERMINAL_PHASES:
        pod.exit_code = report.exit_code
        pod.finished_at = now
        retry_unschedulable(session)
        node_id = pod.node_id
        if spot.requeue_after_stop(ctx, session, pod, now):
            bump_assignments(session, node_id)
        else:
            _maybe_restart(ctx, session, pod, target, now)


def _default_reason(phase: PodPhase, exit_code: int | None) -> str:
    if phase is PodPhase.FAILED:
        return f"Error (exit code {exit_code})" if exit_code is not None else "Error"
    return {PodPhase.SUCCEEDED: "Completed", PodPhase.RUNNING: "Started",
            PodPhase.PULLING: "Pulling", PodPhase.STOPPED: "Stopped"}.get(phase, phase.value)


def _maybe_restart(ctx: ServiceContext, session: Session, pod: PodModel, ended: PodPhase,
                   now: datetime) -> None:
    """Restart per policy with exponential back-off; a user's stop is never undone."""
    if pod.desired_state != "running" or not should_restart(
        RestartPolicy(pod.restart_policy), ended
    ):
        return
    delay = min(ctx.settings.restart_backoff_seconds * 2 ** pod.restart_count,
                ctx.settings.restart_backoff_max_seconds)
    exit_code = pod.exit_code
    node_id = pod.node_id
    requeue(session, pod, now, "Restarting",
            f"restart policy {pod.restart_policy}; exit code {exit_code}; back-off {delay:g}s")
    pod.restart_count += 1
    pod.not_before = now + timedelta(seconds=delay)
    bump_assignments(session, node_id)


def append_log(ctx: ServiceContext, node_id: str, pod_id: str,
               chunk: AgentLogChunkRequest) -> int:
    """Store a chunk of the pod's output at byte ``offset``; returns the next offset expected.

    Chunks must arrive in order; one at the wrong offset stores nothing and the caller
    resends from the returned offset (idempotent across agent restarts).
    """
    with ctx.db.transaction() as session:
        node = session.get_one(NodeModel, node_id)
        check_fencing(node, chunk.fencing_token)
        pod = _bound_pod(session, node, pod_id)
        if chunk.attempt is not None and chunk.attempt != pod.attempt:
            raise Conflict(f"log of attempt {chunk.attempt}; the pod is on {pod.attempt}")
        end = _log_end(session, pod)
        if chunk.offset == end and chunk.data:
            # PostgreSQL's text cannot hold NUL: a space keeps every byte offset.
            session.add(PodLogChunkModel(pod_id=pod.id, attempt=pod.attempt, offset=end,
                                         data=chunk.data.replace("\x00", " ")))
            end += len(chunk.data.encode())
        return end


def _log_end(session: Session, pod: PodModel) -> int:
    last = session.execute(
        select(PodLogChunkModel.offset, PodLogChunkModel.data)
        .where(PodLogChunkModel.pod_id == pod.id, PodLogChunkModel.attempt == pod.attempt)
        .order_by(PodLogChunkModel.offset.desc())
        .limit(1)
    ).first()
    return 0 if last is None else int(last[0]) + len(last[1].encode())
