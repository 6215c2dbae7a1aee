"""What node agents write and read: assignments, pod status, log chunks.

Every write carries the node's fencing token; a stale one is refused (409) before anything
changes, so an agent that lost its lease cannot overwrite what a newer grant decided.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import Select, and_, bindparam, insert, select
from sqlalchemy.orm import Session, aliased

from gpucloud.core.access import NetworkVolumeMount
from gpucloud.core.errors import Conflict, NotFound
from gpucloud.core.models import (
    AgentLogChunkRequest,
    AgentPodStatusRequest,
    AssignmentOut,
    AssignmentsOut,
    VolumeSource,
)
from gpucloud.core.phases import (
    ACTIVE_PHASE_VALUES,
    ACTIVE_PHASES,
    RESTARTING,
    TERMINAL_PHASES,
    PodPhase,
    RestartPolicy,
    should_restart,
)
from gpucloud.db.models import (
    JobModel,
    NodeModel,
    PodLogChunkModel,
    PodModel,
    ProjectModel,
    RegistryAuthModel,
)
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
from gpucloud.services.fencing import check_token
from gpucloud.services.pods import bump_assignments, complete_restart, requeue
from gpucloud.services.scheduling import retry_unschedulable
from gpucloud.services.spec import credentials_for
from gpucloud.services.ssh_keys import public_keys

#: Stops the server decided: the pod keeps this reason, not the agent's "Stopped".
_SERVER_STOPS = {"Preempted", "MaxDurationExceeded"}


def assignments_revision(ctx: ServiceContext, node_id: str) -> int:
    with ctx.db.read() as session:
        return session.get_one(NodeModel, node_id).assignments_revision


def assignments(ctx: ServiceContext, node_id: str) -> AssignmentsOut:
    """The pods the node must run (or stop): live pods bound to it in an active phase.

    Every bind builds one (issue 16), so its cost is bounded whatever the node runs: the
    node; its active pods, each with what it joins to (project, job barrier, registry
    login, a migration's source node); the volume disks it keeps or exports; its
    projects' SSH keys when it runs pods; and, only when some pod needs them, network
    volumes, checkpoints and gang sizes, each read once for all the pods. No query per
    pod."""
    with ctx.db.read() as session:
        node = session.execute(_NODE, {"node_id": node_id}).scalar_one()
        bound = _bound_rows(session, node_id)
        live = [row for row in bound if row[0].deleted_at is None]
        volume_pods, exports = migration.node_volumes(session, node_id)
        # The GPUs held: every active pod's, a deleted one's too until it has stopped.
        busy = gpu_maintenance.holders((row[0].name, row[0].gpu_milli) for row in bound)
        return AssignmentsOut(revision=node.assignments_revision,
                              fencing_token=node.fencing_token,
                              pods=_assignments_of(ctx, session, node, live),
                              volume_pods=volume_pods, volume_exports=exports,
                              gpu_actions=gpu_maintenance.pending(node, busy))


#: A bound pod with what its assignment joins to: the project's name, the barrier's
#: release, the registry login's host, username and password, the volume source node's
#: name, access endpoint and host key (columns, not rows: each column read costs).
_BoundRow = tuple[PodModel, str, datetime | None, str | None, str | None, str | None,
                  str | None, str | None, str | None]


_NODE = select(NodeModel).where(NodeModel.id == bindparam("node_id"))
#: The node's pods in an active phase (deleted ones too: they hold GPUs until they stop),
#: oldest first, with the project's name, the job's barrier release, the registry login
#: the pod names and the source node of its volume migration. Built once: every bind
#: runs it, and building a statement (an alias above all) costs more than running it.
_VOLUME_SOURCE = aliased(NodeModel, name="volume_source")
_BOUND = (
    select(PodModel, ProjectModel.name, JobModel.barrier_released_at,
           RegistryAuthModel.registry_host, RegistryAuthModel.username,
           RegistryAuthModel.password, _VOLUME_SOURCE.name, _VOLUME_SOURCE.access_endpoint,
           _VOLUME_SOURCE.access_host_key)
    .join(ProjectModel, ProjectModel.id == PodModel.project_id)
    .outerjoin(JobModel, JobModel.id == PodModel.job_id)
    .outerjoin(RegistryAuthModel, and_(RegistryAuthModel.project_id == PodModel.project_id,
                                       RegistryAuthModel.name == PodModel.registry_auth))
    .outerjoin(_VOLUME_SOURCE, _VOLUME_SOURCE.id == PodModel.volume_source_node_id)
    .where(PodModel.node_id == bindparam("node_id"),
           PodModel.phase.in_(ACTIVE_PHASE_VALUES))
    .order_by(PodModel.created_at))


def _bound_rows(session: Session, node_id: str) -> list[_BoundRow]:
    return list(session.execute(_BOUND, {"node_id": node_id}))


def _assignments_of(ctx: ServiceContext, session: Session, node: NodeModel,
                    rows: list[_BoundRow]) -> list[AssignmentOut]:
    pods = [row[0] for row in rows]
    keys = public_keys(session, {pod.project_id for pod in pods})
    mounts = volumes.mounts_for_pods(ctx, session, pods, node.volume_mode)
    checkpoints = checkpoint_index.read_for(session, pods)
    plans = interval.plans_for(ctx, session, node, pods, checkpoints)
    out = []
    for pod, project, released, registry, username, password, *source in rows:
        assignment = _with_public_key(_assignment(pod, project, released is not None),
                                      keys.get(pod.project_id))
        _add_volumes(pod, assignment, migration.volume_source(pod, node, *source),
                     mounts.get(pod.id, []))
        credentials = credentials_for(pod, registry, username, password)
        if credentials is not None:
            assignment.registry_username, assignment.registry_password = credentials
        checkpoint_index.add_to_assignment(pod, assignment, checkpoints)
        interval.add_to_assignment(pod, assignment, plans.get(pod.id))
        assignment.mig_policy = mig.mig_policy(node)
        out.append(assignment)
    return out


def _add_volumes(pod: PodModel, assignment: AssignmentOut, source: VolumeSource | None,
                 network_volumes: list[NetworkVolumeMount]) -> None:
    """The pod's volume disk, container disk and network volumes, as this node mounts them."""
    assignment.volume_bytes = pod.volume_bytes
    assignment.volume_path = pod.volume_path
    assignment.container_disk_bytes = pod.container_disk_bytes
    assignment.volume_source = source
    assignment.network_volumes = network_volumes


def _with_public_key(assignment: AssignmentOut, keys: str | None) -> AssignmentOut:
    """RunPod's ``PUBLIC_KEY``: the project's SSH keys, unless the pod sets its own."""
    if keys and "PUBLIC_KEY" not in assignment.env:
        assignment.env = {"PUBLIC_KEY": keys, **assignment.env}
    return assignment


def _assignment(pod: PodModel, project: str, barrier_released: bool) -> AssignmentOut:
    """A job's members share the host network and wait at the start barrier."""
    member = pod.job_id is not None
    return AssignmentOut(
        pod_id=pod.id, name=pod.name, project=project, attempt=pod.attempt,
        # A restart in place is, to the agent, a stop: the server starts the pod again.
        desired_state="stopped" if pod.desired_state == RESTARTING else pod.desired_state,
        phase=PodPhase(pod.phase), image=pod.image,
        command=pod.command, env=pod.env, ports=pod.ports, cpu_milli=pod.cpu_milli,
        memory_bytes=pod.memory_bytes, gpu_uuids=pod.gpu_uuids,
        gpu_milli=round(pod.gpus * 1000) if 0 < pod.gpus < 1 else 0,
        gpu_memory_bytes=pod.gpu_memory_bytes,
        stop_grace_seconds=pod.stop_grace_seconds, host_network=member, barrier=member,
        barrier_released=member and barrier_released, entrypoint=pod.entrypoint,
        stop_notice=spot.notice_of(pod), mig_profile=pod.mig_profile, mig_slot=pod.mig_slot,
    )


def _bound_pod(session: Session, node_id: str, pod_id: str) -> PodModel:
    pod = session.get(PodModel, pod_id)
    if pod is None:
        raise NotFound(f"pod {pod_id!r} not found")
    if pod.node_id != node_id:
        name = session.get_one(NodeModel, node_id).name
        raise Conflict(f"pod {pod_id!r} is not bound to node {name!r}")
    return pod


#: A report's first statement: the node's fencing token, its row locked until the report
#: commits (a new grant, or any change to the node's assignments, waits for it, and the
#: pod is read after it). One narrow column: every pod report runs it, and loading the
#: node's wide row (its GPUs, labels, capacity) into the ORM cost more than the query.
#: The node's fencing token (a log chunk reads it as it is; a report under a lock).
_NODE_TOKEN = select(NodeModel.fencing_token).where(NodeModel.id == bindparam("node_id"))
_LOCKED_TOKEN = _NODE_TOKEN.with_for_update()
#: The token under a share lock: a re-registration or lease grant (which changes it) still
#: waits for the report's commit, but reports of other pods on the same node do not wait
#: for one another (PostgreSQL; SQLite has one writer and no row locks).
_SHARED_TOKEN = _NODE_TOKEN.with_for_update(read=True)


def _token_lock(report: AgentPodStatusRequest) -> Select[int]:
    """How a report locks its node's row while it checks the fencing token. Exclusively
    when it may write the row (an ended pod frees capacity and bumps the assignments; a
    volume migration's state); else shared, so that the ``Running`` reports of a node the
    scheduler packed with pods do not queue one behind another (s47: most of PostgreSQL's
    waits in a 10,000-node backlog drain). A shared holder never takes the row
    exclusively later, so two of them cannot deadlock on it."""
    writes_node = report.phase in TERMINAL_PHASES or report.volume_migration is not None
    return _LOCKED_TOKEN if writes_node else _SHARED_TOKEN


def report_status(ctx: ServiceContext, node_id: str, pod_id: str,
                  report: AgentPodStatusRequest) -> PodPhase:
    """Apply an agent's report of a pod's phase; returns the pod's phase afterwards."""
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        check_token(session.execute(_token_lock(report), {"node_id": node_id}).scalar_one(),
                    report.fencing_token)
        pod = _bound_pod(session, node_id, pod_id)
        if report.attempt is not None and report.attempt != pod.attempt:
            raise Conflict(f"report for attempt {report.attempt}; the pod is on {pod.attempt}")
        current = PodPhase(pod.phase)
        if _already_applied(current, report.phase):
            return current  # a duplicate or a late report of a step already taken
        if report.phase is not current and current not in ACTIVE_PHASES:
            raise Conflict(f"pod {pod.name!r} is {current}; the agent's report is too late")
        _apply_details(session, node_id, pod, report, now)
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


def _apply_details(session: Session, node_id: str, pod: PodModel,
                   report: AgentPodStatusRequest, now: datetime) -> None:
    """What a report carries besides its phase: log tail, address, volume migration, MIG
    device."""
    if report.log_tail is not None:
        pod.log_tail = report.log_tail
    if report.network is not None:
        pod.network = report.network.model_dump()
    if report.volume_migration is not None:  # the node's row is locked already
        migration.apply_report(session, pod, session.get_one(NodeModel, node_id),
                               report.volume_migration, now)
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
        elif not complete_restart(session, pod, now):
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
        connection = session.connection()
        check_token(connection.execute(_NODE_TOKEN, {"node_id": node_id}).scalar_one(),
                    chunk.fencing_token)
        pod = connection.execute(_POD_PLACE, {"pod_id": pod_id}).first()
        if pod is None:
            raise NotFound(f"pod {pod_id!r} not found")
        bound_to, attempt = pod
        if bound_to != node_id:
            name = session.get_one(NodeModel, node_id).name
            raise Conflict(f"pod {pod_id!r} is not bound to node {name!r}")
        if chunk.attempt is not None and chunk.attempt != attempt:
            raise Conflict(f"log of attempt {chunk.attempt}; the pod is on {attempt}")
        last = connection.execute(_LAST_CHUNK, {"pod_id": pod_id, "attempt": attempt}).first()
        end = 0 if last is None else int(last[0]) + len(last[1].encode())
        if chunk.offset == end and chunk.data:
            # PostgreSQL's text cannot hold NUL: a space keeps every byte offset.
            connection.execute(_INSERT_CHUNK, {"pod_id": pod_id, "attempt": attempt,
                                               "offset": end,
                                               "data": chunk.data.replace("\x00", " ")})
            end += len(chunk.data.encode())
        return end


#: A log chunk's statements, built once (every chunk a pod ships runs them) and run on
#: the connection (no ORM rows): the node's token, the pod's node and attempt, the
#: attempt's last chunk (where the next must start), the insert.
_POD_PLACE = select(PodModel.node_id, PodModel.attempt).where(
    PodModel.id == bindparam("pod_id"))
_LAST_CHUNK = (select(PodLogChunkModel.offset, PodLogChunkModel.data)
               .where(PodLogChunkModel.pod_id == bindparam("pod_id"),
                      PodLogChunkModel.attempt == bindparam("attempt"))
               .order_by(PodLogChunkModel.offset.desc()).limit(1))
_INSERT_CHUNK = insert(PodLogChunkModel)
