"""Backfill, the control plane's side: the blocked head-of-queue gang's reservation, and
which later work may use the nodes reserved for it.

The head is the highest-priority, oldest queued job that the last job pass found
``Unschedulable``. Its reservation is computed afresh by every scheduling pass with the
pure planner (``scheduler.backfill.reserve``) from what runs now: each active pod holds its
GPUs (of the gang's model), CPU and memory until its start (or now, not started yet) plus
its declared max duration; a pod that declared none holds them for ever. Later work may
start on the reserved nodes only if it declares a max duration and ends by the reserved
start (``ends_in_time``); other work sees the reserved nodes as closed, and its ``why``
says they are reserved.

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

from sqlalchemy import Row, select
from sqlalchemy.orm import Session

from gpucloud.core.gpu_models import canonical_name
from gpucloud.core.jobs import Topology
from gpucloud.core.phases import ACTIVE_PHASE_VALUES
from gpucloud.db.models import JobModel, NodeModel, PodModel
from gpucloud.scheduler import Explanation, NodeState
from gpucloud.scheduler.backfill import (
    GangNeed,
    Holding,
    Reservation,
    Resources,
    Work,
    ends_in_time,
    reserve,
)
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


#: The blocked head-of-queue gang (built once: every scheduling pass looks).
_HEAD = (select(JobModel)
         .where(JobModel.gang_state == "queued", JobModel.reason == "Unschedulable",
                JobModel.desired_state == "running", JobModel.deleted_at.is_(None),
                JobModel.gpus_per_node > 0)
         .order_by(JobModel.priority.desc(), JobModel.created_at, JobModel.id).limit(1))


def head_reservation(ctx: ServiceContext, nodes: Sequence[NodeState]) -> GangReservation | None:
    """The reservation of the blocked head-of-queue gang, if there is one."""
    with ctx.db.read() as session:
        return head_reservation_in(session, ctx.clock.now(), nodes)


def head_reservation_in(session: Session, now: datetime,
                        nodes: Sequence[NodeState]) -> GangReservation | None:
    """``head_reservation`` read in ``session`` (a scheduling pass's snapshot read)."""
    head = session.scalars(_HEAD).first()
    if head is None:
        return None
    foreign = _foreign_gpus(nodes, head.gpu_type)
    running = _holdings(session, now, foreign)
    need = GangNeed(head.num_nodes, head.gpus_per_node, head.cpu_milli, head.memory_bytes)
    domains = _domains(nodes, _capacity(nodes, foreign), Topology(head.topology))
    planned = _earliest(now.timestamp(), domains, running, need)
    return None if planned is None else GangReservation(head.id, head.name, planned,
                                                           head.priority)


def _earliest(now: float, domains: list[dict[str, Resources]], running: list[Holding],
              need: GangNeed) -> Reservation | None:
    """The earliest reservation in any one domain, if it starts in the future.

    The planner sees whole GPUs (of the gang's model), CPU and memory per node. A start of
    now means enough nodes in one domain have all of that free: either capacity has freed
    since the job pass found the gang unschedulable (the next pass places it), or it is
    held back by what the planner does not model (the profile's checks of the GPUs
    themselves, beyond counting them). Either way, reserving would only idle nodes.
    """
    plans = [reserve(now, capacity, _within(running, capacity), need) for capacity in domains]
    future = [p for p in plans if p is not None and p.start > now]
    return min(future, key=lambda p: (p.start, sorted(p.nodes)), default=None)


def _within(running: list[Holding], capacity: dict[str, Resources]) -> list[Holding]:
    """What runs on the nodes of ``capacity`` (work spanning domains: its part there)."""
    names = capacity.keys()
    parts = [h if h.resources.keys() <= names else
             Holding(h.key, {n: r for n, r in h.resources.items() if n in names}, h.end)
             for h in running]
    return [h for h in parts if h.resources]


def _domains(nodes: Sequence[NodeState], capacity: dict[str, Resources],
             topology: Topology) -> list[dict[str, Resources]]:
    """Capacity per topology domain the gang may use (its widest level: one rack for
    ``same-rack``; the whole cluster for ``any``); nodes without the labels are in none."""
    keys = LEVELS[topology][-1]
    groups: dict[tuple[str | None, ...], dict[str, Resources]] = defaultdict(dict)
    for node in nodes:
        where = tuple(node.labels.get(k) for k in keys)
        if node.name in capacity and None not in where:
            groups[where][node.name] = capacity[node.name]
    return list(groups.values())


def _foreign_gpus(nodes: Sequence[NodeState], gpu_type: str | None) -> dict[str, frozenset[int]]:
    """Per usable node (ready, not cordoned), the indices of the GPUs the gang cannot take:
    those of another model when it asks for one (on most nodes, none)."""
    usable = [n for n in nodes if n.ready and not n.cordoned]
    if not gpu_type:
        return dict.fromkeys((n.name for n in usable), frozenset())
    wanted = canonical_name(gpu_type)
    return {n.name: frozenset(g.index for g in n.gpus if canonical_name(g.model) != wanted)
            for n in usable}


def _capacity(nodes: Sequence[NodeState],
              foreign: dict[str, frozenset[int]]) -> dict[str, Resources]:
    """Per usable node: the GPUs the gang could take, its CPU and its memory."""
    return {n.name: Resources(len(n.gpus) - len(foreign[n.name]), n.cpu_milli, n.memory_bytes)
            for n in nodes if n.name in foreign}


#: A pod's claim on a node: id, node id, GPU milli by index, CPU, memory, start, max duration.
_Claim = Row[str, str | None, dict[str, int] | None, int, int, datetime | None, float | None]


def _claims(session: Session, now: datetime) -> list[_Claim]:
    """Active pods where they are bound, and live preemption reservations where they are
    held (as ``scheduling._held`` counts them)."""
    bound = session.execute(
        select(PodModel.id, PodModel.node_id, PodModel.gpu_milli, PodModel.cpu_milli,
               PodModel.memory_bytes, PodModel.started_at, PodModel.max_duration_seconds)
        .where(PodModel.phase.in_(ACTIVE_PHASE_VALUES), PodModel.node_id.is_not(None))
    ).all()
    nominated = session.execute(
        select(PodModel.id, PodModel.nominated_node_id, PodModel.nominated_gpu_milli,
               PodModel.cpu_milli, PodModel.memory_bytes, PodModel.started_at,
               PodModel.max_duration_seconds)
        .where(PodModel.phase == "Pending", PodModel.nominated_node_id.is_not(None),
               PodModel.nominated_until > now)
    ).all()
    return [*bound, *nominated]


def _holdings(session: Session, now: datetime,
              foreign: dict[str, frozenset[int]]) -> list[Holding]:
    """The claims on usable nodes (those of ``foreign``) as holdings by node name: the GPUs
    each touches that the gang could take (a shared GPU counts whole: a gang needs it
    whole), its CPU and memory, and its expected end."""
    # Node id (typed as the rows give it) -> name and the GPUs there the gang cannot take.
    located: dict[str | None, tuple[str, frozenset[int]]] = {
        node_id: (name, foreign[name]) for node_id, name in
        session.execute(select(NodeModel.id, NodeModel.name)) if name in foreign}
    held: list[Holding] = []
    for pod_id, node_id, gpu_milli, cpu_milli, memory_bytes, started, max_duration in _claims(
            session, now):
        if node_id not in located:
            continue
        name, other = located[node_id]
        gpus = gpu_milli or {}
        taken = len(gpus) - (sum(1 for i in gpus if int(i) in other) if other else 0)
        held.append(Holding(pod_id, {name: Resources(taken, cpu_milli, memory_bytes)},
                            _end(started, max_duration, now)))
    return held


def _end(started: datetime | None, max_duration: float | None, now: datetime) -> float | None:
    """When work ends as declared: its start (now, not started yet) plus its max duration."""
    if max_duration is None:
        return None
    return _epoch(started if started is not None else now) + max_duration


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
