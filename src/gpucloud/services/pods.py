"""Pods: user intent (create, stop, start, delete) and what the user reads back."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from functools import partial
from typing import Any

from sqlalchemy import bindparam, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpucloud.core.errors import Conflict, InvalidInput, NotFound
from gpucloud.core.models import (
    PodCreateRequest,
    PodEventOut,
    PodLogsOut,
    PodOut,
    PodWhyOut,
)
from gpucloud.core.phases import (
    ACTIVE_PHASE_VALUES,
    ACTIVE_PHASES,
    RESTARTING,
    TERMINAL_PHASES,
    NodeStatus,
    PodPhase,
    RestartPolicy,
)
from gpucloud.core.spec import check_gpus
from gpucloud.core.spot import priority_class_of
from gpucloud.db.models import Base, NodeModel, PodEventModel, PodLogChunkModel, PodModel
from gpucloud.db.session import on_commit
from gpucloud.gpu.mps import SHARED_FAULT_WARNING
from gpucloud.scheduler import Explanation
from gpucloud.services import (
    admission,
    checkpoint_index,
    interval,
    meter,
    mig,
    migration,
    priorities,
    templates,
    volumes,
    wakeups,
)
from gpucloud.services.context import ServiceContext, new_id
from gpucloud.services.events import record_event, transition
from gpucloud.services.projects import Principal
from gpucloud.services.proxy import new_proxy_token
from gpucloud.services.spec import check_gpu_memory, check_mig, check_spec, spec_columns, spec_out
from gpucloud.services.transparent import check_transparent

#: Pending reasons whose message is the answer to ``why``: over quota, or waiting for the
#: victims of its preemption to stop.
_WAITING_REASONS = {"OverQuota", "Preempting"}
_INSERT_POD = insert(Base.metadata.tables[PodModel.__tablename__])
_PODS = Base.metadata.tables[PodModel.__tablename__]
_CHUNKS = Base.metadata.tables[PodLogChunkModel.__tablename__]


def pod_out(pod: PodModel, project_name: str, node_name: str | None) -> PodOut:
    return PodOut(
        id=pod.id, name=pod.name, project=project_name, phase=PodPhase(pod.phase),
        reason=pod.reason, message=pod.message, node=node_name, gpu_uuids=pod.gpu_uuids,
        exit_code=pod.exit_code, restart_count=pod.restart_count,
        desired_state=pod.desired_state, gpus=pod.gpus, ports=pod.ports,
        restart=RestartPolicy(pod.restart_policy), job_id=pod.job_id, rank=pod.rank,
        priority_class=pod.priority_class, priority=pod.priority,
        max_duration=pod.max_duration_seconds, template=pod.template,
        created_at=pod.created_at, updated_at=pod.updated_at, started_at=pod.started_at,
        finished_at=pod.finished_at, preemptions=pod.preemptions or 0,  # None: not flushed
        last_preemption_reason=pod.last_preemption_reason,
        last_preempted_at=pod.last_preempted_at, time_lost_seconds=pod.time_lost_seconds or 0.0,
        mig_slot=pod.mig_slot, mig_device=mig.device_out(pod),
        gpu_sharing_warning=SHARED_FAULT_WARNING if 0 < pod.gpus < 1 else None,
        **spec_out(pod), **_network_out(pod),
    )


def _network_out(pod: PodModel) -> dict[str, Any]:
    """``ip`` and ``ports_runtime`` from what the agent reported (none before it ran)."""
    network = pod.network or {}
    return {"ip": network.get("ip"), "ports_runtime": network.get("ports", [])}


def create_pod(ctx: ServiceContext, caller: Principal, request: PodCreateRequest, *,
               pod_id: str | None = None, endpoint_id: str | None = None) -> PodOut:
    """Record the intent (a Pending pod and its first event) in one transaction.

    A pod from a template starts from the template's spec; the fields the request gives
    override it. Names it refers to (template, registry credentials) are checked first.
    A serverless endpoint's worker (services/autoscale) gives its ``endpoint_id`` and the
    ``pod_id`` its env already names.
    """
    request = templates.apply_template(ctx, caller, request)
    check_spec(ctx, caller.project_id, request)
    check_mig(request, request.gpus)
    check_gpu_memory(request, request.gpus)
    check_transparent(ctx, request, gpus=request.gpus)
    now = ctx.clock.now()
    priority_class, priority = priorities.resolve_cached(
        ctx, priority_class_of(request, request.priority_class))
    row = dict(
        id=pod_id or new_id(), project_id=caller.project_id, name=request.name,
        phase=PodPhase.PENDING.value, reason="Created", message=None, desired_state="running",
        ports=request.ports, gpus=request.gpus, restart_policy=request.restart.value,
        node_id=None, gpu_uuids=[], gpu_milli={}, exit_code=None, attempt=0, restart_count=0,
        created_at=now, updated_at=now, version=0, priority_class=priority_class,
        priority=priority, max_duration_seconds=request.max_duration,
        template=request.template, proxy_token=new_proxy_token(), endpoint_id=endpoint_id,
        worker_idle_since=now if endpoint_id else None, **spec_columns(request),
    )
    pod = PodModel(**row)
    # The API's hottest write is one INSERT, atomic on its own: the creation event is
    # derived from the row (see list_events), the unique index settles duplicate names.
    # A project with a spend limit or prepaid credit: the check and the INSERT are one
    # transaction holding its limit row (services/admission).
    try:
        if not admission.admit_and_insert(ctx, caller, row, _INSERT_POD):
            ctx.db.execute_atomic(_INSERT_POD, row)
    except IntegrityError as error:
        if _name_taken(ctx, caller, request.name):
            raise InvalidInput(
                "name", f"a pod named {request.name!r} already exists in project "
                f"{caller.project_name!r}"
            ) from None
        raise Conflict(f"pod not created: {error.orig}") from None
    return pod_out(pod, caller.project_name, None)


def _name_taken(ctx: ServiceContext, caller: Principal, name: str) -> bool:
    with ctx.db.transaction() as session:
        return session.scalar(
            select(PodModel.id).where(PodModel.project_id == caller.project_id,
                                      PodModel.name == name, PodModel.deleted_at.is_(None))
        ) is not None


def _find(session: Session, caller: Principal, ref: str) -> PodModel:
    """A live pod of the caller's project by id or name; NotFound hides other projects."""
    pod = session.scalar(
        select(PodModel).where(
            PodModel.project_id == caller.project_id,
            PodModel.deleted_at.is_(None),
            (PodModel.id == ref) | (PodModel.name == ref),
        )
    )
    if pod is None:
        raise NotFound(f"pod {ref!r} not found")
    return pod


def _not_a_member(pod: PodModel) -> None:
    """Members of a job are controlled through their job, never one by one."""
    if pod.job_id is not None:
        raise Conflict(f"pod {pod.name!r} is member {pod.rank} of a job; use `gpucloud job` "
                       "to stop or delete it")


def _node_name(session: Session, node_id: str | None) -> str | None:
    if node_id is None:
        return None
    return session.scalar(select(NodeModel.name).where(NodeModel.id == node_id))


def get_pod(ctx: ServiceContext, caller: Principal, ref: str) -> PodOut:
    with ctx.db.read() as session:
        pod = _find(session, caller, ref)
        out = pod_out(pod, caller.project_name, _node_name(session, pod.node_id))
        out.volume_node = _node_name(session, pod.volume_node_id)
        out.last_checkpoint = checkpoint_index.last_checkpoint(session, pod)
        interval.add_to_pod_out(ctx, session, pod, out)
        return out


def list_pods(ctx: ServiceContext, caller: Principal, phase: PodPhase | None = None,
              limit: int = 1000) -> list[PodOut]:
    with ctx.db.read() as session:
        query = (
            select(PodModel, NodeModel.name)
            .outerjoin(NodeModel, NodeModel.id == PodModel.node_id)
            .where(PodModel.project_id == caller.project_id, PodModel.deleted_at.is_(None))
            .order_by(PodModel.created_at, PodModel.id)
            .limit(limit)
        )
        if phase is not None:
            query = query.where(PodModel.phase == phase.value)
        rows = session.execute(query).all()
        return [pod_out(pod, caller.project_name, node) for pod, node in rows]


def list_events(ctx: ServiceContext, caller: Principal, ref: str) -> list[PodEventOut]:
    with ctx.db.read() as session:
        pod = _find(session, caller, ref)
        events = session.scalars(
            select(PodEventModel).where(PodEventModel.pod_id == pod.id).order_by(PodEventModel.id)
        )
        created = PodEventOut(time=pod.created_at, from_phase=None, to_phase=PodPhase.PENDING,
                              reason="Created")
        return [created] + [
            PodEventOut(time=e.time, from_phase=PodPhase(e.from_phase) if e.from_phase else None,
                        to_phase=PodPhase(e.to_phase) if e.to_phase else None,
                        reason=e.reason, message=e.message)
            for e in events
        ]


def bump_assignments(session: Session, node_id: str | None) -> None:
    """Wake the node's agent: its list of assigned pods changed (the revision for every
    replica, and at once, on commit, for a long poll in this process)."""
    if node_id:
        session.execute(
            update(NodeModel)
            .where(NodeModel.id == node_id)
            .values(assignments_revision=NodeModel.assignments_revision + 1)
        )
        on_commit(session, partial(wakeups.ASSIGNMENTS.notify, node_id))


def bump_project_nodes(session: Session, project_id: str,
                       registry_auth: str | None = None) -> None:
    """Wake the agents running the project's pods (only those naming ``registry_auth``,
    when given): something their assignments derive from changed without a bind or a
    stop (its SSH keys, a registry login), and the answer kept for their revision
    (services/assignment_answers) must not be served again. Nodes locked in id order."""
    query = select(PodModel.node_id).where(
        PodModel.project_id == project_id, PodModel.phase.in_(ACTIVE_PHASE_VALUES),
        PodModel.node_id.is_not(None), PodModel.deleted_at.is_(None))
    if registry_auth is not None:
        query = query.where(PodModel.registry_auth == registry_auth)
    node_ids = sorted({n for n in session.scalars(query.distinct()) if n})
    if not node_ids:
        return
    session.execute(select(NodeModel.id).where(NodeModel.id.in_(node_ids))
                    .order_by(NodeModel.id).with_for_update())
    session.execute(update(NodeModel).where(NodeModel.id.in_(node_ids))
                    .values(assignments_revision=NodeModel.assignments_revision + 1))
    for node_id in node_ids:
        on_commit(session, partial(wakeups.ASSIGNMENTS.notify, node_id))


def stop_pod(ctx: ServiceContext, caller: Principal, ref: str,
             grace_seconds: float | None = None) -> PodOut:
    """Stop a pod: at once when nothing runs, else ask its agent (SIGTERM, then SIGKILL
    after ``grace_seconds``, by default the agent's own, 30 s)."""
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        pod = _find(session, caller, ref)
        _not_a_member(pod)
        pod.stop_grace_seconds = grace_seconds
        pod.stop_notice = None  # the user's stop: no requeue after a preemption under way
        phase = PodPhase(pod.phase)
        if phase in {PodPhase.PENDING, PodPhase.LOST}:
            transition(session, pod, PodPhase.STOPPED, now, "StoppedByUser")
            pod.desired_state = "stopped"
            pod.finished_at = now
        elif phase in ACTIVE_PHASES:
            if pod.desired_state != "stopped":
                pod.desired_state = "stopped"
                pod.version += 1
                record_event(session, pod.id, now, "StopRequested", "the node agent stops it")
                bump_assignments(session, pod.node_id)
        else:
            raise Conflict(f"pod {pod.name!r} is not running (phase {phase})")
        return pod_out(pod, caller.project_name, _node_name(session, pod.node_id))


def start_pod(ctx: ServiceContext, caller: Principal, ref: str,
              gpus: float | None = None, migrate: bool = False) -> PodOut:
    """Start a stopped or finished pod again: back to Pending, to be scheduled anew (a pod
    with a volume disk only on the node holding it). ``gpus`` changes its GPU count from
    now on: 0 starts it without GPUs, for access to its volume (RunPod's zero-GPU pod).
    ``migrate``: any node with room will do; the volume disk is copied there first
    (services/migration)."""
    now = ctx.clock.now()
    if gpus is not None:
        try:
            gpus = check_gpus(gpus)
        except ValueError as error:
            raise InvalidInput("gpus", str(error)) from None
    with ctx.db.transaction() as session:
        pod = _find(session, caller, ref)
        _not_a_member(pod)
        if PodPhase(pod.phase) not in TERMINAL_PHASES:
            raise Conflict(f"pod {pod.name!r} is {pod.phase}; only an ended pod can be started")
        volumes.check_still_there(session, pod.project_id, pod.network_volumes)
        migration.prepare_start(session, pod, migrate)
        if gpus is not None:
            pod.gpus = gpus
        requeue(session, pod, now, "StartedByUser")
        return pod_out(pod, caller.project_name, None)


def restart_pod(ctx: ServiceContext, caller: Principal, ref: str,
                grace_seconds: float | None = None) -> PodOut:
    """Restart a pod in place, answering at once. An active pod is asked to stop
    (``desired_state`` ``restarting``: SIGTERM, then SIGKILL after ``grace_seconds``)
    and the server starts it again when its agent reports it ended
    (:func:`complete_restart`): the same pod, a new attempt, placed again on the node
    holding its volume disk, its network volumes kept. A pending pod is stopped and
    started at once; an ended one just starts."""
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        pod = _find(session, caller, ref)
        _not_a_member(pod)
        volumes.check_still_there(session, pod.project_id, pod.network_volumes)
        phase = PodPhase(pod.phase)
        if phase in ACTIVE_PHASES:
            _ask_restart(session, pod, now, grace_seconds)
            return pod_out(pod, caller.project_name, _node_name(session, pod.node_id))
        if phase is PodPhase.PENDING:
            transition(session, pod, PodPhase.STOPPED, now, "StoppedByUser")
            pod.desired_state, pod.finished_at = "stopped", now
        _requeue_in_place(session, pod, now, "StartedByUser")
        return pod_out(pod, caller.project_name, None)


def _ask_restart(session: Session, pod: PodModel, now: datetime,
                 grace_seconds: float | None) -> None:
    """The restart's stop, once (a second restart while it stops changes nothing); a stop
    already under way (the user's, a preemption's) becomes the restart's."""
    if pod.desired_state == RESTARTING:
        return
    pod.desired_state = RESTARTING
    pod.stop_grace_seconds = grace_seconds
    pod.stop_notice = None  # started again in place, not requeued as a preemption's victim
    pod.version += 1
    record_event(session, pod.id, now, "RestartRequested",
                 "the node agent stops it; the server starts it again once it has stopped")
    bump_assignments(session, pod.node_id)


def complete_restart(session: Session, pod: PodModel, now: datetime) -> bool:
    """The second half of :func:`restart_pod`, once the pod has ended (its agent's report,
    its node lost, a drain's deadline): Pending again, to be placed anew; True if it was
    restarting. A network volume deleted meanwhile leaves it stopped, with an event."""
    if pod.desired_state != RESTARTING or pod.deleted_at is not None:
        return False
    node_id = pod.node_id
    try:
        volumes.check_still_there(session, pod.project_id, pod.network_volumes)
    except InvalidInput as error:
        pod.desired_state = "stopped"
        record_event(session, pod.id, now, "RestartFailed", error.message)
        return False
    _requeue_in_place(session, pod, now, "RestartedByUser",
                      "stopped for the restart; started again in place")
    bump_assignments(session, node_id)
    return True


def _requeue_in_place(session: Session, pod: PodModel, now: datetime, reason: str,
                      message: str | None = None) -> None:
    """``pod start`` without ``--migrate``: back to the node holding its volume disk."""
    migration.prepare_start(session, pod, False)
    requeue(session, pod, now, reason, message)


def requeue(session: Session, pod: PodModel, now: datetime, reason: str,
            message: str | None = None) -> None:
    """Back to Pending with no node: the scheduler places it at its next pass (a restart
    back-off, when wanted, is set by the caller afterwards)."""
    transition(session, pod, PodPhase.PENDING, now, reason, message)
    pod.desired_state = "running"
    pod.node_id = None
    pod.gpu_uuids = []
    pod.gpu_milli = {}
    pod.exit_code = None
    pod.unschedulable = None
    pod.not_before = None
    pod.network = None  # the next attempt gets its own address and ports
    pod.stop_notice = None


def delete_pod(ctx: ServiceContext, caller: Principal, ref: str) -> None:
    """Delete a pod; if it runs, its agent stops it once it is gone from the assignments."""
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        pod = _find(session, caller, ref)
        _not_a_member(pod)
        pod.deleted_at = now
        pod.desired_state = "deleted"
        pod.version += 1
        record_event(session, pod.id, now, "Deleted")
        meter.close_run(session, pod, now, "Deleted")  # its agent kills it without a report
        if PodPhase(pod.phase) in ACTIVE_PHASES:
            bump_assignments(session, pod.node_id)


def why_pod(ctx: ServiceContext, caller: Principal, ref: str) -> PodWhyOut:
    with ctx.db.read() as session:
        pod = _find(session, caller, ref)
        phase = PodPhase(pod.phase)
        reasons = pod.unschedulable or {}
        if phase is not PodPhase.PENDING:
            summary = f"pod is {phase}" + (f" on node {_node_name(session, pod.node_id)}"
                                           if pod.node_id else "")
        elif pod.reason in _WAITING_REASONS and pod.message:
            summary = pod.message
        elif reasons:
            summary = Explanation(reasons).summary()
        elif pod.not_before and pod.not_before > ctx.clock.now():
            summary = f"waiting to restart until {pod.not_before.isoformat()} (back-off)"
        else:
            summary = "waiting for the scheduler's next pass"
        if phase is PodPhase.PENDING and pod.volume_node_id is not None:
            summary = f"{_volume_note(session, pod.volume_node_id)}; {summary}"
        elif phase is PodPhase.PENDING and pod.volume_source_node_id is not None:
            summary = (f"its volume is copied from node "
                       f"{_node_name(session, pod.volume_source_node_id)} to the node it gets; "
                       f"{summary}")
        return PodWhyOut(pod=pod.name, phase=phase, summary=summary, reasons=reasons)


def _volume_note(session: Session, node_id: str) -> str:
    """Where a pending pod's volume disk is, and whether that node can take it now."""
    node = session.get(NodeModel, node_id)
    if node is None:
        return "its volume's node is gone"
    note = f"its volume is on node {node.name}"
    if node.status != NodeStatus.READY.value:
        return (f"{note}, which is {node.status}: the pod starts there when the node is back "
                "(or delete the pod, which deletes the volume)")
    if node.cordoned:
        return f"{note}, which is cordoned"
    return note


def read_logs(ctx: ServiceContext, caller: Principal, ref: str, offset: int = 0,
              tail_bytes: int | None = None, attempt: int | None = None) -> PodLogsOut:
    """The current attempt's output from byte ``offset`` (or its last ``tail_bytes``).

    A follower names the ``attempt`` its offset belongs to: when the pod has restarted
    since, it gets the rest of that attempt, every later one, then the current one from
    its start — so following never skips the beginning of a new run.
    """
    return read_logs_of(ctx, caller, ref, offset, tail_bytes, attempt)[1]


def read_logs_of(ctx: ServiceContext, caller: Principal, ref: str, offset: int = 0,
                 tail_bytes: int | None = None,
                 attempt: int | None = None) -> tuple[str, PodLogsOut]:
    """``read_logs``, and the pod's id (what a waiting read listens on: api/routers/pods.py).

    A follower within the current attempt (an ``offset`` past 0, no tail) gets only the
    chunks from the one holding ``offset`` on, not the whole log again at each read.
    """
    with ctx.db.read() as session:
        connection = session.connection()
        pod = connection.execute(_LOG_POD, {"project": caller.project_id, "ref": ref}).first()
        if pod is None:
            raise NotFound(f"pod {ref!r} not found")
        pod_id, current_attempt, phase, log_tail = pod
        first = current_attempt if attempt is None else min(attempt, current_attempt)
        following = first == current_attempt and tail_bytes is None and offset > 0
        rows = connection.execute(_LOG_CHUNKS_FROM if following else _LOG_CHUNKS, {
            "pod": pod_id, "first": first, "current": current_attempt, "offset": offset,
        }).all()
    finished = PodPhase(phase) in TERMINAL_PHASES
    output: dict[int, bytes] = defaultdict(bytes)
    base: int | None = None  # where the current attempt's first chunk read starts
    for number, at, data in rows:
        if number == current_attempt and base is None:
            base = at
        output[number] += data.encode()
    current = output.get(current_attempt) or (log_tail or "").encode()
    base = base or 0
    end = base + len(current)
    restarted = first < current_attempt
    earlier = b"".join([output[first][offset:], *(output[n] for n in range(
        first + 1, current_attempt))]) if restarted else b""
    start = (0 if restarted else max(0, end - tail_bytes) if tail_bytes is not None
             else min(offset, end))
    text = (earlier + current[start - base:]).decode(errors="ignore")
    return pod_id, PodLogsOut(text=text, offset=start, next_offset=end, finished=finished,
                              attempt=current_attempt)


#: A log read's statements, built once (a follower reads at every chunk its pod ships):
#: the live pod of the caller's project by id or name (what ``_find`` finds, only the
#: columns a read needs), then its chunks of attempts ``first`` to ``current``…
_LOG_POD = (select(_PODS.c.id, _PODS.c.attempt, _PODS.c.phase, _PODS.c.log_tail)
            .where(_PODS.c.project_id == bindparam("project"), _PODS.c.deleted_at.is_(None),
                   (_PODS.c.id == bindparam("ref")) | (_PODS.c.name == bindparam("ref")))
            .limit(1))
_LOG_CHUNKS = (select(_CHUNKS.c.attempt, _CHUNKS.c.offset, _CHUNKS.c.data)
               .where(_CHUNKS.c.pod_id == bindparam("pod"),
                      _CHUNKS.c.attempt >= bindparam("first"),
                      _CHUNKS.c.attempt <= bindparam("current"))
               .order_by(_CHUNKS.c.attempt, _CHUNKS.c.offset))
#: … or, for a follower within the current attempt, from the chunk holding ``offset`` on
#: (the start of the last chunk at or before it; 0 if none).
_LOG_CHUNKS_FROM = _LOG_CHUNKS.where(_CHUNKS.c.offset >= select(
    func.coalesce(func.max(_CHUNKS.c.offset), 0)).where(
    _CHUNKS.c.pod_id == bindparam("pod"), _CHUNKS.c.attempt == bindparam("current"),
    _CHUNKS.c.offset <= bindparam("offset")).scalar_subquery())
