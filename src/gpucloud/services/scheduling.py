"""The scheduling pass: lease pending pods, snapshot the cluster, plan, guarded apply.

Three steps, as every background loop here: (1) lease rows in a short transaction,
(2) compute outside any transaction (the pure ``scheduler`` library), (3) apply each
decision with guarded UPDATEs — the pod on ``version`` and ``lock_token``, the node on
``version`` — so a pod stopped or deleted meanwhile, or a node cordoned or lost
meanwhile, makes the bind a no-op that the next pass retries.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy import bindparam, or_, select, update
from sqlalchemy.orm import Session

from gpucloud.core.phases import ACTIVE_PHASES, NodeStatus, PodPhase
from gpucloud.db.models import Base, JobModel, NodeModel, PodModel
from gpucloud.db.session import rows_changed
from gpucloud.scheduler import Decision, GpuState, NodeState, PodRequest, Scheduler
from gpucloud.services.context import ServiceContext, new_id
from gpucloud.services.events import record_event, record_events

LOCK_SECONDS = 30.0
#: An unschedulable pod is looked at again after this long, or at once when capacity
#: appears (a node registers or is uncordoned, a pod ends): see ``retry_unschedulable``.
UNSCHEDULABLE_RETRY_SECONDS = 30.0
_ACTIVE = [p.value for p in ACTIVE_PHASES]


@dataclass
class PassResult:
    considered: int = 0
    scheduled: list[str] = field(default_factory=list)
    unschedulable: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)


@dataclass
class _Snapshot:
    nodes: list[NodeState]
    by_name: dict[str, NodeModel]


@dataclass(frozen=True)
class LeasedPod:
    """What the pass needs of a pending pod: its request, guard and previous reasons."""

    id: str
    version: int
    gpus: float
    gpu_type: str | None
    cpu_milli: int
    memory_bytes: int
    unschedulable: dict[str, int] | None


_LEASED_COLUMNS = (PodModel.id, PodModel.version, PodModel.gpus, PodModel.gpu_type,
                   PodModel.cpu_milli, PodModel.memory_bytes, PodModel.unschedulable)


def lease_pending(ctx: ServiceContext, limit: int) -> tuple[str, list[LeasedPod]]:
    """Take a lock on up to ``limit`` schedulable pending pods, oldest first."""
    now = ctx.clock.now()
    token = new_id()
    with ctx.db.transaction() as session:
        ids = session.scalars(
            select(PodModel.id)
            .where(PodModel.phase == PodPhase.PENDING.value, PodModel.deleted_at.is_(None),
                   PodModel.desired_state == "running", PodModel.job_id.is_(None),
                   or_(PodModel.not_before.is_(None), PodModel.not_before <= now),
                   or_(PodModel.lock_expires_at.is_(None), PodModel.lock_expires_at <= now))
            .order_by(PodModel.created_at, PodModel.id)
            .limit(limit)
        ).all()
        if not ids:
            return token, []
        session.execute(
            update(PodModel)
            .where(PodModel.id.in_(ids),
                   or_(PodModel.lock_expires_at.is_(None), PodModel.lock_expires_at <= now))
            .values(lock_token=token, lock_expires_at=now + timedelta(seconds=LOCK_SECONDS))
        )
        rows = session.execute(
            select(*_LEASED_COLUMNS).where(PodModel.lock_token == token)
            .order_by(PodModel.created_at, PodModel.id)
        ).all()
        return token, [LeasedPod(*row) for row in rows]


def pod_request(pod: LeasedPod) -> PodRequest:
    whole = int(pod.gpus) if pod.gpus >= 1 else 0
    share = round(pod.gpus * 1000) if 0 < pod.gpus < 1 else 0
    return PodRequest(key=pod.id, gpus=whole, gpu_milli=share, gpu_model=pod.gpu_type,
                      cpu_milli=pod.cpu_milli, memory_bytes=pod.memory_bytes)


def _usage(session: Session) -> tuple[dict[str, dict[int, int]], dict[str, int], dict[str, int]]:
    """GPU milli per node and GPU index, CPU and memory held by active pods."""
    gpu: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    cpu: dict[str, int] = defaultdict(int)
    memory: dict[str, int] = defaultdict(int)
    rows = session.execute(
        select(PodModel.node_id, PodModel.gpu_milli, PodModel.cpu_milli, PodModel.memory_bytes)
        .where(PodModel.phase.in_(_ACTIVE), PodModel.node_id.is_not(None))
    )
    for node_id, gpu_milli, cpu_milli, memory_bytes in rows:
        if node_id is None:
            continue
        for index, milli in gpu_milli.items():
            gpu[node_id][int(index)] += milli
        cpu[node_id] += cpu_milli
        memory[node_id] += memory_bytes
    return gpu, cpu, memory


def node_state(node: NodeModel, gpu_used: dict[int, int], cpu_used: int,
               memory_used: int) -> NodeState:
    gpus = tuple(
        GpuState(index=g["index"], uuid=g["uuid"], model=g["model"],
                 memory_mib=g["memory_mib"], numa_node=g.get("numa_node", 0),
                 nvlink_peers=tuple(g.get("nvlink_peers", ())),
                 used_milli=min(1000, gpu_used.get(g["index"], 0)))
        for g in node.gpus
    )
    return NodeState(name=node.name, cpu_milli=node.cpu_milli, memory_bytes=node.memory_bytes,
                     gpus=gpus, labels=dict(node.labels), cordoned=node.cordoned,
                     ready=node.status == NodeStatus.READY.value,
                     cpu_used_milli=cpu_used, memory_used_bytes=memory_used)


def snapshot(ctx: ServiceContext) -> _Snapshot:
    with ctx.db.transaction() as session:
        nodes = session.scalars(select(NodeModel).order_by(NodeModel.name)).all()
        gpu, cpu, memory = _usage(session)
    states = [node_state(n, gpu.get(n.id, {}), cpu.get(n.id, 0), memory.get(n.id, 0))
              for n in nodes]
    return _Snapshot(states, {n.name: n for n in nodes})


def run_pass(ctx: ServiceContext, scheduler: Scheduler, limit: int = 256) -> PassResult:
    """One scheduling pass over up to ``limit`` pending pods."""
    token, pods = lease_pending(ctx, limit)
    result = PassResult(considered=len(pods))
    if not pods:
        return result
    snap = snapshot(ctx)
    decisions = scheduler.schedule(snap.nodes, [pod_request(p) for p in pods])
    node_versions = {name: node.version for name, node in snap.by_name.items()}
    rejected = [(p, d) for p, d in zip(pods, decisions, strict=True) if d.placement is None]
    _mark_unschedulable(ctx, token, rejected)
    result.unschedulable = [pod.id for pod, _ in rejected]
    for pod, decision in zip(pods, decisions, strict=True):
        if decision.placement is None:
            continue
        if _bind(ctx, pod, token, decision, snap.by_name, node_versions):
            result.scheduled.append(pod.id)
        else:
            result.conflicts.append(pod.id)
    return result


def _bind(ctx: ServiceContext, pod: LeasedPod, token: str, decision: Decision,
          nodes: dict[str, NodeModel], node_versions: dict[str, int]) -> bool:
    assert decision.placement is not None
    node = nodes[decision.placement.node]
    gpu_by_index = {g["index"]: g["uuid"] for g in node.gpus}
    gpu_milli = {str(i): m for i, m in sorted(decision.placement.gpu_milli.items())}
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        if not claim_node(session, node.id, node_versions[node.name]):
            _release(session, pod, token)
            return False
        bound = rows_changed(
            session,
            update(PodModel)
            .where(PodModel.id == pod.id, PodModel.version == pod.version,
                   PodModel.lock_token == token, PodModel.phase == PodPhase.PENDING.value,
                   PodModel.deleted_at.is_(None))
            .values(phase=PodPhase.SCHEDULED.value, node_id=node.id,
                    gpu_uuids=[gpu_by_index[int(i)] for i in gpu_milli],
                    gpu_milli=gpu_milli, attempt=PodModel.attempt + 1, reason="Scheduled",
                    message=f"bound to {node.name}", unschedulable=None, updated_at=now,
                    lock_token=None, lock_expires_at=None, version=PodModel.version + 1),
        )
        if not bound:
            session.rollback()
            return False
        node_versions[node.name] += 1
        record_event(session, pod.id, now, "Scheduled", f"bound to {node.name}",
                     PodPhase.PENDING.value, PodPhase.SCHEDULED.value)
    return True


def claim_node(session: Session, node_id: str, version: int) -> bool:
    """Guarded bump of the node: fails if it changed (cordoned, lost, re-registered)."""
    return bool(rows_changed(
        session,
        update(NodeModel)
        .where(NodeModel.id == node_id, NodeModel.version == version,
               NodeModel.status == NodeStatus.READY.value, NodeModel.cordoned.is_(False))
        .values(version=NodeModel.version + 1,
                assignments_revision=NodeModel.assignments_revision + 1),
    ))


def retry_unschedulable(session: Session) -> None:
    """Capacity may have appeared: let the next pass look at unschedulable pods and jobs
    again."""
    session.execute(
        update(PodModel)
        .where(PodModel.phase == PodPhase.PENDING.value, PodModel.reason == "Unschedulable",
               PodModel.not_before.is_not(None))
        .values(not_before=None)
    )
    session.execute(
        update(JobModel)
        .where(JobModel.gang_state == "queued", JobModel.reason == "Unschedulable",
               JobModel.not_before.is_not(None))
        .values(not_before=None)
    )


def _release(session: Session, pod: LeasedPod, token: str) -> None:
    session.execute(
        update(PodModel).where(PodModel.id == pod.id, PodModel.lock_token == token)
        .values(lock_token=None, lock_expires_at=None)
    )


def _mark_unschedulable(ctx: ServiceContext, token: str,
                        rejected: list[tuple[LeasedPod, Decision]]) -> None:
    """Keep the pods Pending with their reasons and release them, in one transaction and
    one executemany; an event for each pod whose reasons changed. They are looked at again
    after UNSCHEDULABLE_RETRY_SECONDS, or at once when capacity appears.

    A pod stopped or deleted since it was leased fails the guard and keeps its new state;
    at worst it also gets a FailedScheduling event it no longer needs.
    """
    if not rejected:
        return
    now = ctx.clock.now()
    pods = Base.metadata.tables[PodModel.__tablename__]
    statement = (
        update(pods)
        .where(pods.c.id == bindparam("pod_id"), pods.c.lock_token == token,
               pods.c.version == bindparam("expected_version"))
        .values(unschedulable=bindparam("reasons"), reason="Unschedulable", lock_token=None,
                lock_expires_at=None,
                not_before=now + timedelta(seconds=UNSCHEDULABLE_RETRY_SECONDS))
    )
    rows = [{"pod_id": pod.id, "expected_version": pod.version,
             "reasons": _reasons(decision)} for pod, decision in rejected]
    with ctx.db.transaction() as session:
        session.connection().execute(statement, rows)
        record_events(session, [
            {"pod_id": pod.id, "time": now, "reason": "FailedScheduling",
             "message": decision.explanation.summary()}
            for pod, decision in rejected
            if decision.explanation and _reasons(decision) != (pod.unschedulable or {})
        ])


def _reasons(decision: Decision) -> dict[str, int]:
    return dict(decision.explanation.reasons) if decision.explanation else {}
