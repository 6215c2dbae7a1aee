"""Backfill, the control plane's side: the blocked head-of-queue gang's reservation, and
which later work may use the nodes reserved for it.

The head is the highest-priority, oldest queued job that the last job pass found
``Unschedulable``. Its reservation is computed afresh by every scheduling pass with the
pure planner (``scheduler.backfill.reserve``) from what runs now: each active pod holds its
GPUs until its start (or now, not started yet) plus its declared max duration; a pod that
declared none holds them for ever. Later work may start on the reserved nodes only if it
declares a max duration and ends by the reserved start (``ends_in_time``); other work sees
the reserved nodes as closed, and its ``why`` says they are reserved.

The gang's start is protected only as far as the declarations hold, and the max-duration
controller (``services.max_duration``) makes them hold: work is stopped when it exceeds
its declared duration.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.core.gpu_models import canonical_name
from gpucloud.core.jobs import Topology
from gpucloud.core.phases import ACTIVE_PHASE_VALUES
from gpucloud.db.models import JobModel, NodeModel, PodModel
from gpucloud.scheduler import Explanation, NodeState
from gpucloud.scheduler.backfill import GangNeed, Holding, Reservation, Work, ends_in_time, reserve
from gpucloud.scheduler.gang import LEVELS
from gpucloud.scheduler.plugins.filters import CORDONED
from gpucloud.services.context import ServiceContext


@dataclass(frozen=True)
class GangReservation:
    """The head gang's reservation: its job, the reserved node names and expected start
    (``reservation.start`` in epoch seconds; ``inf`` when it waits on undeclared work)."""

    job_id: str
    job_name: str
    reservation: Reservation
    priority: int

    def closes(self, priority: int, max_duration: float | None, now: datetime) -> bool:
        """Whether the reserved nodes are closed to work of ``priority`` declaring
        ``max_duration``. Work of higher priority than the gang is not held back by it
        (a priority queue places it first anyway), nor is work that ends in time."""
        if priority > self.priority:
            return False
        work = Work("", 0, max_duration=max_duration)
        return not ends_in_time(work, now.timestamp(), self.reservation)

    def when(self) -> str:
        start = self.reservation.start
        if math.isinf(start):
            return "once the work on them without a max duration ends"
        return f"from {datetime.fromtimestamp(start, UTC).isoformat(timespec='seconds')}"

    def label(self) -> str:
        """The reason later work is kept off the reserved nodes, as ``why`` shows it."""
        return (f"reserved for job {self.job_name} {self.when()} (work that declares a "
                "--max-duration ending by then may backfill)")

    def describe(self) -> str:
        """The head gang's own ``why``: its reserved nodes and expected start."""
        nodes = ", ".join(sorted(self.reservation.nodes))
        return f"nodes {nodes} reserved for it {self.when()}"


def head_reservation(ctx: ServiceContext, nodes: Sequence[NodeState]) -> GangReservation | None:
    """The reservation of the blocked head-of-queue gang, if there is one."""
    now = ctx.clock.now()
    with ctx.db.read() as session:
        head = session.scalars(
            select(JobModel)
            .where(JobModel.gang_state == "queued", JobModel.reason == "Unschedulable",
                   JobModel.desired_state == "running", JobModel.deleted_at.is_(None),
                   JobModel.gpus_per_node > 0)
            .order_by(JobModel.priority.desc(), JobModel.created_at, JobModel.id).limit(1)
        ).first()
        if head is None:
            return None
        running = _holdings(session, now)
    need = GangNeed(head.num_nodes, head.gpus_per_node)
    domains = _domains(nodes, head.gpu_type, Topology(head.topology))
    planned = _earliest(now.timestamp(), domains, running, need)
    return None if planned is None else GangReservation(head.id, head.name, planned,
                                                           head.priority)


def _earliest(now: float, domains: list[dict[str, int]], running: list[Holding],
              need: GangNeed) -> Reservation | None:
    """The earliest reservation in any one domain, if it starts in the future.

    A start of now means the gang fits by GPU counts, so it is blocked by what the planner
    does not model (CPU, memory, GPU model of a shared GPU): reserving would only idle nodes.
    """
    plans = [reserve(now, capacity, _within(running, capacity), need) for capacity in domains]
    future = [p for p in plans if p is not None and p.start > now]
    return min(future, key=lambda p: (p.start, sorted(p.nodes)), default=None)


def _within(running: list[Holding], capacity: dict[str, int]) -> list[Holding]:
    """What runs on the nodes of ``capacity`` (work spanning domains: its part there)."""
    parts = [Holding(h.key, {n: g for n, g in h.gpus.items() if n in capacity}, h.end)
             for h in running]
    return [h for h in parts if h.gpus]


def _domains(nodes: Sequence[NodeState], gpu_type: str | None,
             topology: Topology) -> list[dict[str, int]]:
    """Capacity per topology domain the gang may use (its widest level: one rack for
    ``same-rack``; the whole cluster for ``any``); nodes without the labels are in none."""
    keys = LEVELS[topology][-1]
    capacity = _capacity(nodes, gpu_type)
    groups: dict[tuple[str | None, ...], dict[str, int]] = defaultdict(dict)
    for node in nodes:
        where = tuple(node.labels.get(k) for k in keys)
        if node.name in capacity and None not in where:
            groups[where][node.name] = capacity[node.name]
    return list(groups.values())


def _capacity(nodes: Sequence[NodeState], gpu_type: str | None) -> dict[str, int]:
    """Whole GPUs per usable node, of the gang's model when it asks for one."""
    wanted = canonical_name(gpu_type) if gpu_type else None
    return {n.name: sum(1 for g in n.gpus if wanted is None or canonical_name(g.model) == wanted)
            for n in nodes if n.ready and not n.cordoned}


def _holdings(session: Session, now: datetime) -> list[Holding]:
    """Active pods and live preemption reservations as holdings by node name: the GPUs each
    touches (a shared GPU counts whole: a gang needs it whole) and its expected end."""
    rows = session.execute(
        select(PodModel.id, PodModel.node_id, PodModel.gpu_milli, PodModel.started_at,
               PodModel.max_duration_seconds)
        .where(PodModel.phase.in_(ACTIVE_PHASE_VALUES), PodModel.node_id.is_not(None))
    ).all()
    reserved = session.execute(
        select(PodModel.id, PodModel.nominated_node_id, PodModel.nominated_gpu_milli,
               PodModel.started_at, PodModel.max_duration_seconds)
        .where(PodModel.phase == "Pending", PodModel.nominated_node_id.is_not(None),
               PodModel.nominated_until > now)
    ).all()
    names = {node_id: name for node_id, name in
             session.execute(select(NodeModel.id, NodeModel.name))}
    held: list[Holding] = []
    for pod_id, node_id, gpu_milli, started, max_duration in [*rows, *reserved]:
        if not node_id or not gpu_milli:
            continue
        begin = started if started is not None else now
        end = None if max_duration is None else _epoch(begin) + max_duration
        held.append(Holding(pod_id, {names[node_id]: len(gpu_milli)}, end))
    return held


def _epoch(moment: datetime) -> float:
    """Epoch seconds of a stored time (SQLite gives naive UTC, PostgreSQL aware)."""
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def restricted(nodes: Sequence[NodeState], held: GangReservation) -> list[NodeState]:
    """The nodes with the reserved ones closed (cordoned, on this working copy only)."""
    return [dataclasses.replace(n, cordoned=True) if n.name in held.reservation.nodes else n
            for n in nodes]


def closed_count(nodes: Sequence[NodeState], held: GangReservation) -> int:
    """How many nodes ``restricted`` closes that were open."""
    return sum(1 for n in nodes if n.name in held.reservation.nodes and not n.cordoned)


def explain(explanation: Explanation | None, closed: int,
            held: GangReservation) -> Explanation | None:
    """Count the nodes closed for the reservation under its own reason, not as cordoned."""
    if explanation is None or closed == 0:
        return explanation
    reasons = defaultdict(int, explanation.reasons)
    moved = min(reasons.get(CORDONED, 0), closed)
    reasons[CORDONED] -= moved
    reasons[held.label()] += moved
    return Explanation({k: v for k, v in reasons.items() if v > 0})
