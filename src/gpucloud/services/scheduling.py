"""The scheduling pass: lease pending pods, snapshot the cluster, plan, guarded apply.

Three steps, as every background loop here: (1) lease rows in a short transaction,
(2) compute outside any transaction (the pure ``scheduler`` library), (3) apply each
decision with guarded UPDATEs — the pod on ``version`` and ``lock_token``, the node on
``version`` — so a pod stopped or deleted meanwhile, or a node cordoned or lost
meanwhile, makes the bind a no-op that the next pass retries.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy import Connection, Text, and_, bindparam, cast, or_, select, update
from sqlalchemy.orm import Session

from gpucloud.core.capabilities import CHECKPOINT_TRANSPARENT
from gpucloud.core.gpu_models import canonical_name
from gpucloud.core.phases import ACTIVE_PHASE_VALUES, NodeStatus, PodPhase
from gpucloud.core.trace import mark
from gpucloud.core.tunables import number_from_env
from gpucloud.db.models import Base, JobModel, NodeModel, PodModel
from gpucloud.db.session import on_commit, rows_changed
from gpucloud.scheduler import (
    Decision,
    GpuState,
    NodeState,
    Placement,
    PodRequest,
    Scheduler,
)
from gpucloud.scheduler.preemption import with_placements
from gpucloud.scheduler.quota import Ledger, drf_capacity, gpu_capacity
from gpucloud.scheduler.types import FULL_GPU_MILLI, NodeLoad
from gpucloud.services import (
    backfill,
    capacity,
    gpu_maintenance,
    gpu_milli,
    loadaware,
    migration,
    quotas,
    row_sources,
    wakeups,
)
from gpucloud.services.context import ServiceContext, new_id
from gpucloud.services.events import record_event, record_events
from gpucloud.services.gpu_shares import mig_facts, share_memory_of
from gpucloud.services.mig import MigHeld, held_of, mig_labels, mig_slots, slots_free
from gpucloud.services.transparent import criu_labels, transparent_selector

LOCK_SECONDS = 30.0
OVER_QUOTA = "OverQuota"
#: An unschedulable pod is looked at again after this long, or at once when capacity
#: appears (a node registers or is uncordoned, a pod ends): see ``retry_unschedulable``.
UNSCHEDULABLE_RETRY_SECONDS = 30.0
#: Pending pods per pass. A pass's fixed cost grows with the nodes and the active pods
#: (the snapshot's key rows and usage, the quota ledger: about 0.5 s of CPU at 10,000
#: nodes even with the incremental snapshot) and its binds are batched (``bind_all``, a
#: commit per ``_BIND_CHUNK``), so a backlog drains faster in fewer, larger passes
#: (bench/scheduler_pass.py, 10,000 nodes on PostgreSQL, one busy run: 905 pods per CPU
#: second at 1,024 a pass, 2,397 at 4,096; 318 at 1,024 with a full snapshot each pass).
PASS_LIMIT = 4096
#: The pass's statements are built once on the Core tables and run on the transaction's
#: connection: a one-pod pass (a warm start) spent most of its time building statements,
#: their cache keys and the ORM's execution steps, not in the database.
_PODS = Base.metadata.tables[PodModel.__tablename__]
_NODES = Base.metadata.tables[NodeModel.__tablename__]


def notify_nodes(node_ids: list[str]) -> None:
    """Wake the assignment long polls of nodes a bind just claimed (committed)."""
    for node_id in node_ids:
        wakeups.ASSIGNMENTS.notify(node_id)


#: How a pass tells the agents of the nodes its binds claimed, once they committed: by
#: default ``notify_nodes``; the controller first builds the answers of waiting polls.
Announce = Callable[[list[str]], None]


@dataclass
class PassResult:
    considered: int = 0
    scheduled: list[str] = field(default_factory=list)
    unschedulable: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    over_quota: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)


Usage = tuple[dict[str, dict[int, int]], dict[str, int], dict[str, int]]


@dataclass
class Snapshot:
    """The nodes as the scheduler sees them (live reservations count as used), the rows,
    and the uncapped usage per node id (to tell when a reservation is free)."""

    nodes: list[NodeState]
    by_name: dict[str, NodeModel]
    usage: Usage
    #: The MIG instances held per node id, reservations included (``mig.mig_held``).
    mig: dict[str, list[MigHeld]] = field(default_factory=dict)
    #: What each active pod and live reservation holds, for the quota ledger.
    holdings: list[quotas.Holding] = field(default_factory=list)


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
    project_id: str
    priority: int
    nominated_node_id: str | None
    nominated_gpu_milli: dict[str, int] | None
    nominated_until: datetime | None
    max_duration_seconds: float | None
    volume_bytes: int | None = None
    #: The name of the node holding the pod's volume disk: the only one it may go to.
    volume_node: str | None = None
    #: ``transparent``: only nodes whose CRIU canary passed (``services.transparent``).
    checkpoint_mode: str | None = None
    #: The node it was just preempted from, avoided until ``avoid_until`` (services/spot).
    avoid_node: str | None = None
    avoid_until: datetime | None = None
    #: ``--mig PROFILE``: one MIG instance (the scheduler picks the GPU and start slot).
    mig_profile: str | None = None
    #: ``--gpu-memory``: a share's device memory limit (the GPU must have it left).
    gpu_memory_bytes: int | None = None
    #: A MIG preemptor's slot on its reservation (services/preemption), else None.
    mig_slot: int | None = None

    def reservation(self, now: datetime) -> tuple[str, dict[str, int]] | None:
        """The node id and GPUs held for this pod by a preemption, while they are."""
        if self.nominated_node_id and self.nominated_gpu_milli is not None and (
                self.nominated_until is not None and self.nominated_until > now):
            return self.nominated_node_id, self.nominated_gpu_milli
        return None


#: The node a pending pod was just preempted from (``lease_pending`` drops it once
#: ``avoid_until`` has passed on the service clock).
_AVOID_NODE = (select(_NODES.c.name).where(_NODES.c.id == _PODS.c.avoid_node_id)
               .scalar_subquery().label("avoid_node"))
_LEASED_COLUMNS = (_PODS.c.id, _PODS.c.version, _PODS.c.gpus, _PODS.c.gpu_type,
                   _PODS.c.cpu_milli, _PODS.c.memory_bytes, _PODS.c.unschedulable,
                   _PODS.c.project_id, _PODS.c.priority, _PODS.c.nominated_node_id,
                   _PODS.c.nominated_gpu_milli, _PODS.c.nominated_until,
                   _PODS.c.max_duration_seconds, _PODS.c.volume_bytes,
                   _PODS.c.checkpoint_mode,
                   select(_NODES.c.name).where(_NODES.c.id == _PODS.c.volume_node_id)
                   .scalar_subquery().label("volume_node"), _AVOID_NODE,
                   _PODS.c.avoid_until, _PODS.c.mig_profile, _PODS.c.gpu_memory_bytes,
                   _PODS.c.mig_slot)
_LOCK_FREE = or_(_PODS.c.lock_expires_at.is_(None),
                 _PODS.c.lock_expires_at <= bindparam("now"))
#: The lease, one statement built once: lock up to ``limit`` schedulable pending pods
#: (highest priority first, then oldest) and return what the pass needs of them. Its
#: rows come back in no particular order: ``lease_pending`` sorts them on
#: (priority, created_at, id).
_LEASE = (
    update(_PODS)
    .where(_PODS.c.id.in_(
        select(_PODS.c.id)
        .where(_PODS.c.phase == PodPhase.PENDING.value, _PODS.c.deleted_at.is_(None),
               _PODS.c.desired_state == "running", _PODS.c.job_id.is_(None),
               or_(_PODS.c.not_before.is_(None), _PODS.c.not_before <= bindparam("now")),
               _LOCK_FREE)
        .order_by(_PODS.c.priority.desc(), _PODS.c.created_at, _PODS.c.id)
        .limit(bindparam("limit"))
        .scalar_subquery()), _LOCK_FREE)
    .values(lock_token=bindparam("token"), lock_expires_at=bindparam("until"))
    .returning(*_LEASED_COLUMNS, _PODS.c.created_at))


def lease_pending(ctx: ServiceContext, limit: int) -> tuple[str, list[LeasedPod]]:
    """Take a lock on up to ``limit`` schedulable pending pods: highest priority first,
    then oldest. One write transaction of one statement (its fence aside), none found
    included."""
    now = ctx.clock.now()
    token = new_id()
    with ctx.db.transaction() as session:
        rows = sorted(session.connection().execute(_LEASE, {
            "now": now, "limit": limit, "token": token,
            "until": now + timedelta(seconds=LOCK_SECONDS)}),
            key=lambda row: (-row.priority, row.created_at, row.id))
    fields = [name for name in rows[0]._fields if name != "created_at"] if rows else []
    return token, [_avoiding(LeasedPod(**{name: row._mapping[name] for name in fields}), now)
                   for row in rows]


def _avoiding(pod: LeasedPod, now: datetime) -> LeasedPod:
    """The pod, without its avoided node once that has run out."""
    if pod.avoid_node is not None and (pod.avoid_until is None or pod.avoid_until <= now):
        return replace(pod, avoid_node=None)
    return pod


def pod_request(pod: LeasedPod) -> PodRequest:
    whole = int(pod.gpus) if pod.gpus >= 1 and pod.mig_profile is None else 0
    share = round(pod.gpus * 1000) if 0 < pod.gpus < 1 else 0
    return PodRequest(key=pod.id, gpus=whole, gpu_milli=share, gpu_model=pod.gpu_type,
                      mig_profile=pod.mig_profile,
                      gpu_memory_mib=-(-(pod.gpu_memory_bytes or 0) // (1024 * 1024)),
                      cpu_milli=pod.cpu_milli, memory_bytes=pod.memory_bytes,
                      required_node=pod.volume_node,
                      avoid_nodes=(pod.avoid_node,) if pod.avoid_node else (),
                      node_selector=(transparent_selector(pod.gpus)
                                     if pod.checkpoint_mode == CHECKPOINT_TRANSPARENT else {}))


#: Every active pod's holding and every live reservation's (a pending preemptor's), in
#: one statement: a snapshot's usage, MIG instances and share memory and the quota
#: ledger all come from these rows (one read, not seven). Built once.
_HOLDINGS = select(
    _PODS.c.phase, _PODS.c.project_id, _PODS.c.node_id, _PODS.c.nominated_node_id,
    gpu_milli.as_text(_PODS.c.gpu_milli), gpu_milli.as_text(_PODS.c.nominated_gpu_milli),
    _PODS.c.cpu_milli, _PODS.c.memory_bytes, _PODS.c.mig_profile, _PODS.c.mig_slot,
    _PODS.c.gpu_memory_bytes,
).where(or_(
    and_(_PODS.c.phase.in_(ACTIVE_PHASE_VALUES), _PODS.c.node_id.is_not(None)),
    and_(_PODS.c.phase == PodPhase.PENDING.value, _PODS.c.nominated_node_id.is_not(None),
         _PODS.c.nominated_until > bindparam("now"))))


@dataclass
class _Held:
    """The snapshot's side of ``_HOLDINGS``."""

    usage: Usage
    mig: dict[str, list[MigHeld]]
    shares: dict[str, dict[int, int]]
    ledger: list[quotas.Holding]


def _held(session: Session, now: datetime) -> _Held:
    """GPU milli per node and GPU index, CPU and memory held by active pods and by live
    reservations of pending preemptors; their MIG instances (``mig.mig_held``), the
    memory limits of active shares (``gpu_shares.share_memory_held``) and the ledger's
    holdings (``quotas.load_ledger``)."""
    gpu: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    cpu: dict[str, int] = defaultdict(int)
    memory: dict[str, int] = defaultdict(int)
    mig: list[tuple[str | None, list[str], str | None, int | None, bool]] = []
    shares: list[tuple[str | None, list[str], int | None]] = []
    ledger: list[quotas.Holding] = []
    for (phase, project, bound_to, nominated, milli_text, nominated_text, cpu_milli,
         memory_bytes, profile, slot, share_memory) in session.connection().execute(
            _HOLDINGS, {"now": now}):
        reserved = phase == PodPhase.PENDING.value
        node_id = nominated if reserved else bound_to
        pairs = gpu_milli.pairs(nominated_text if reserved else milli_text)
        indexes = [index for index, _ in pairs]
        ledger.append((project, node_id, pairs, cpu_milli, memory_bytes))
        mig.append((node_id, indexes, profile, slot, reserved))
        if not reserved and share_memory is not None and profile is None:
            shares.append((node_id, indexes, share_memory))
        if node_id is None:
            continue
        for index, milli in pairs:
            gpu[node_id][int(index)] += milli
        cpu[node_id] += cpu_milli
        memory[node_id] += memory_bytes
    return _Held((gpu, cpu, memory), held_of(mig), share_memory_of(shares), ledger)


def node_state(node: NodeModel, gpu_used: dict[int, int], cpu_used: int,
               memory_used: int, load: NodeLoad | None = None,
               mig_held: list[MigHeld] | None = None,
               share_memory: dict[int, int] | None = None) -> NodeState:
    slots = mig_slots(node.gpus, mig_held) if mig_held else {}  # most nodes hold none
    memory = share_memory or {}
    gpus = tuple(
        GpuState(index=g["index"], uuid=g["uuid"], model=g["model"],
                 memory_mib=g["memory_mib"], numa_node=g.get("numa_node", 0),
                 nvlink_peers=tuple(g.get("nvlink_peers", ())),
                 used_milli=min(1000, gpu_used.get(g["index"], 0)),
                 mig_used=slots.get(g["index"], ()),
                 memory_used_mib=memory.get(g["index"], 0), **mig_facts(node, g))
        for g in node.gpus
        if g.get("healthy", True)  # a GPU its health checks failed is out (gpu/health)
        and not gpu_maintenance.blocks_scheduling(g)  # a MIG mode switch drains it
    )
    return NodeState(name=node.name, cpu_milli=node.cpu_milli, memory_bytes=node.memory_bytes,
                     gpus=gpus, labels=mig_labels(node, criu_labels(node)),
                     cordoned=node.cordoned,
                     ready=node.status == NodeStatus.READY.value,
                     cpu_used_milli=cpu_used, memory_used_bytes=memory_used, load=load)


#: What a snapshot reads of a node row, the JSON columns as their text: a row whose key
#: is unchanged need not be loaded (nor its JSON decoded) again (``SnapshotCache``). Every
#: attribute of ``Snapshot.by_name`` that a caller reads must be in it.
_NODE_KEY = (_NODES.c.id, _NODES.c.version, _NODES.c.name, _NODES.c.status,
             _NODES.c.cordoned, _NODES.c.cpu_milli, _NODES.c.memory_bytes,
             _NODES.c.mig_policy, cast(_NODES.c.gpus, Text), cast(_NODES.c.labels, Text),
             cast(_NODES.c.capabilities, Text))
_NODE_KEYS = select(*_NODE_KEY).order_by(_NODES.c.name)
#: Ids per ``IN`` list when reloading changed rows (well under SQLite's parameter limit).
_RELOAD_CHUNK = 1000


class SnapshotCache:
    """The node rows and ``NodeState``s of the last snapshot, reused where nothing changed.

    Rebuilding 10,000 nodes each pass (load every row, decode its GPUs, build its state,
    and the scheduler's arrays from that) was most of a pass at fleet scale. With a cache
    a pass reads one narrow key row per node, loads only the rows whose key changed (a
    bind bumps its node's version) and builds a new ``NodeState`` only for a node whose
    row or usage changed; the others are the same objects as last pass, which lets
    ``Scheduler`` reuse their rows of its arrays too. The result is the snapshot a full
    rebuild gives (tests/integration/test_scheduling_snapshot.py checks it).
    """

    def __len__(self) -> int:
        """How many node rows are cached."""
        with self._lock:
            return len(self._rows)

    def __init__(self) -> None:
        self._rows: dict[str, tuple[tuple[object, ...], NodeModel]] = {}
        self._states: dict[str, tuple[NodeModel, tuple[object, ...], NodeState]] = {}
        self._lock = threading.Lock()

    def nodes(self, session: Session) -> list[NodeModel]:
        """Every node row by name, loading only those new or changed since last time."""
        keys = [tuple(row) for row in session.connection().execute(_NODE_KEYS)]
        with self._lock:
            known = dict(self._rows)
        stale = [key[0] for key in keys if known.get(str(key[0]), ((),))[0] != key]
        fresh = _load_nodes(session, stale, everything=len(stale) > len(keys) // 2)
        rows = {str(key[0]): (key, fresh.get(str(key[0])) or known[str(key[0])][1])
                for key in keys if str(key[0]) in fresh or str(key[0]) in known}
        with self._lock:
            self._rows = rows
        return [rows[str(key[0])][1] for key in keys if str(key[0]) in rows]

    def claimed(self, node_id: str, version: int) -> None:
        """A bind of this pass claimed the node, moving its ``version`` to ``version``
        and nothing else of its key: the cached row takes the new version, so that the
        next pass need not load the row again (a bind's own bump is no change). Only
        from the version just before; any other change since the row was read differs
        from the cached key in some column, and the next pass reloads the row."""
        with self._lock:
            cached = self._rows.get(node_id)
            if cached is None or cached[0][1] != version - 1:
                return
            key, row = cached
            row.version = version
            self._rows[node_id] = ((key[0], version, *key[2:]), row)

    def states(self, nodes: list[NodeModel], usage: Callable[[str], tuple[object, ...]],
               build: Callable[[NodeModel], NodeState]) -> list[NodeState]:
        """The nodes' states: last pass's object for a node whose row (the same cached
        object) and ``usage(id)`` are the same; the states of nodes gone are dropped."""
        with self._lock:
            known = self._states
            states: dict[str, tuple[NodeModel, tuple[object, ...], NodeState]] = {}
            for node in nodes:
                used = usage(node.id)
                cached = known.get(node.id)
                if cached is not None and cached[0] is node and cached[1] == used:
                    states[node.id] = cached
                else:
                    states[node.id] = (node, used, build(node))
            self._states = states
        return [states[node.id][2] for node in nodes]


def _load_nodes(session: Session, ids: list[str], everything: bool) -> dict[str, NodeModel]:
    """Full rows of ``ids`` (all rows when most are wanted: one scan beats many lists),
    detached from ``session`` at once: the cache keeps them across passes, and a rollback
    of this read (the database went away before the snapshot was done) would expire
    them, leaving rows whose unchanged key never reloads them and whose every attribute
    raises ``DetachedInstanceError`` (scheduling stopped for good after a restart)."""
    if everything:
        out = {n.id: n for n in session.scalars(select(NodeModel))}
    else:
        out = {}
        for start in range(0, len(ids), _RELOAD_CHUNK):
            chunk = ids[start:start + _RELOAD_CHUNK]
            out |= {n.id: n for n in session.scalars(
                select(NodeModel).where(NodeModel.id.in_(chunk)))}
    for node in out.values():
        session.expunge(node)
    return out


def snapshot(ctx: ServiceContext, cache: SnapshotCache | None = None) -> Snapshot:
    """The cluster as the scheduler sees it; with ``cache``, built incrementally."""
    with ctx.db.read() as session:
        return snapshot_in(session, ctx.clock.now(), cache)


def snapshot_in(session: Session, now: datetime, cache: SnapshotCache | None = None
                ) -> Snapshot:
    """``snapshot`` read in ``session`` (a pass reads its ledger in the same one)."""
    nodes = (cache.nodes(session) if cache is not None
             else list(session.scalars(select(NodeModel).order_by(NodeModel.name)).all()))
    holdings = _held(session, now)
    gpu, cpu, memory = holdings.usage
    loads = loadaware.node_loads(session, now, nodes)
    held, shares = holdings.mig, holdings.shares

    def state_of(n: NodeModel) -> NodeState:
        return node_state(n, gpu.get(n.id, {}), cpu.get(n.id, 0), memory.get(n.id, 0),
                          loads.get(n.id), held.get(n.id), shares.get(n.id))

    def usage_of(node_id: str) -> tuple[object, ...]:  # compared with ==: dicts unordered
        return (gpu.get(node_id), cpu.get(node_id), memory.get(node_id), loads.get(node_id),
                held.get(node_id), shares.get(node_id))

    states = ([state_of(n) for n in nodes] if cache is None
              else cache.states(nodes, usage_of, state_of))
    return Snapshot(states, {n.name: n for n in nodes}, (gpu, cpu, memory), held,
                    holdings.ledger)


def reservation_free(snap: Snapshot, node_id: str, gpu_milli: dict[str, int]) -> bool:
    """Whether a reservation's node has room for it now: the usage counts the reservation
    itself, so nothing may be over capacity (the victims are gone)."""
    node = next((n for n in snap.by_name.values() if n.id == node_id), None)
    if node is None or node.status != NodeStatus.READY.value or node.cordoned:
        return False
    gpu, cpu, memory = snap.usage
    used = gpu.get(node_id, {})
    return (all(used.get(int(i), 0) <= FULL_GPU_MILLI for i in gpu_milli)
            and cpu.get(node_id, 0) <= node.cpu_milli
            and memory.get(node_id, 0) <= node.memory_bytes)


def run_pass(ctx: ServiceContext, scheduler: Scheduler, limit: int = PASS_LIMIT,
             cache: SnapshotCache | None = None,
             announce: Announce = notify_nodes) -> PassResult:
    """One scheduling pass over up to ``limit`` pending pods (``cache``: the controller's,
    so that a pass rebuilds only the nodes that changed; ``announce``: how the agents of
    the nodes bound to are told, see ``bind_all``).

    Pods holding a reservation bind onto it once its victims are gone; the others are
    checked against their project's quota, ordered by priority, then by their project's
    dominant share (DRF), then by age, and placed.
    """
    retry_marked(ctx)
    token, leased = lease_pending(ctx, limit)
    result = PassResult(considered=len(leased))
    if not leased:
        return result
    mark("scheduler.pass.leased", pods=len(leased))
    snap, ledger, names, held = _read_cluster(ctx, cache)
    mark("scheduler.pass.read")
    node_versions = {name: node.version for name, node in snap.by_name.items()}
    binds: list[tuple[LeasedPod, Decision]] = []
    pods = [p for p in leased if not _bind_reserved(ctx, p, token, snap, binds, result)]
    pods, over = admit(ledger, names, _fair_order(pods, ledger, snap.nodes),
                       gpu_capacity(snap.nodes))
    _mark_over_quota(ctx, token, over)
    result.over_quota = [pod.id for pod, _ in over]
    decisions = (scheduler.decisions(snap.nodes, [pod_request(p) for p in pods])
                 if held is None else iter(_schedule(scheduler, snap.nodes, pods, held,
                                                     ctx.clock.now())))
    # Bound a chunk at a time as the decisions come: the first pods reach their nodes
    # while the rest of a large pass is still being planned.
    rejected: list[tuple[LeasedPod, Decision]] = []
    for pod, decision in zip(pods, decisions, strict=True):
        (binds if decision.placement is not None else rejected).append((pod, decision))
        if len(binds) >= _BIND_CHUNK:
            _bind_into(ctx, token, binds, snap, node_versions, result, announce)
            binds = []
    _bind_into(ctx, token, binds, snap, node_versions, result, announce)
    if cache is not None:
        for name, version in node_versions.items():
            if version != snap.by_name[name].version:
                cache.claimed(snap.by_name[name].id, version)
    _mark_unschedulable(ctx, token, rejected)
    result.unschedulable = [pod.id for pod, _ in rejected]
    return result


def _bind_into(ctx: ServiceContext, token: str, binds: list[tuple[LeasedPod, Decision]],
               snap: Snapshot, node_versions: dict[str, int], result: PassResult,
               announce: Announce) -> None:
    bound, conflicts = bind_all(ctx, token, binds, snap.by_name, node_versions, announce)
    result.scheduled += bound
    result.conflicts += conflicts


def _schedule(scheduler: Scheduler, nodes: list[NodeState], pods: list[LeasedPod],
              held: backfill.GangReservation | None, now: datetime) -> list[Decision]:
    """Decisions for ``pods`` (in their order). While a blocked gang holds a backfill
    reservation: pods that outrank the gang are placed first, anywhere; then the pods that
    could delay it, off its nodes; then the pods that end in time on what is left,
    reserved nodes included."""
    if held is None:
        return scheduler.schedule(nodes, [pod_request(p) for p in pods])
    ahead: list[LeasedPod] = []
    kept: list[LeasedPod] = []
    free: list[LeasedPod] = []
    for pod in pods:
        group = (ahead if pod.priority > held.priority
                 else kept if held.closes(pod.priority, pod.max_duration_seconds, now)
                 else free)
        group.append(pod)
    first, nodes = _placed(scheduler, nodes, ahead)
    kept_decisions = scheduler.schedule(backfill.restricted(nodes, held),
                                        [pod_request(p) for p in kept])
    nodes = _with_decisions(nodes, kept, kept_decisions)
    last, _ = _placed(scheduler, nodes, free)
    closed = backfill.closed_count(nodes, held)
    by_key = {d.pod_key: d for d in [*first, *last]} | {
        d.pod_key: Decision(d.pod_key, d.placement,
                            backfill.explain(d.explanation, closed, held), d.status)
        for d in kept_decisions}
    return [by_key[p.id] for p in pods]


def _placed(scheduler: Scheduler, nodes: list[NodeState],
            pods: list[LeasedPod]) -> tuple[list[Decision], list[NodeState]]:
    """Decisions for ``pods`` and the nodes with their placements taken."""
    decisions = scheduler.schedule(nodes, [pod_request(p) for p in pods]) if pods else []
    return decisions, _with_decisions(nodes, pods, decisions)


def _with_decisions(nodes: list[NodeState], pods: list[LeasedPod],
                    decisions: list[Decision]) -> list[NodeState]:
    placed = [(pod_request(p), d.placement) for p, d in zip(pods, decisions, strict=True)
              if d.placement is not None]
    return with_placements(nodes, [r for r, _ in placed], [pl for _, pl in placed])


def _bind_reserved(ctx: ServiceContext, pod: LeasedPod, token: str, snap: Snapshot,
                   binds: list[tuple[LeasedPod, Decision]], result: PassResult) -> bool:
    """Handle a pod that holds a reservation: bind it there (added to ``binds``), or keep
    it waiting; False for a pod with none (the ordinary path places it)."""
    held = pod.reservation(ctx.clock.now())
    if held is None:
        return False
    node_id, gpu_milli = held
    mig = ({int(i): (pod.mig_profile, pod.mig_slot) for i in gpu_milli}
           if pod.mig_profile is not None and pod.mig_slot is not None else {})
    if not reservation_free(snap, node_id, gpu_milli) or not _mig_free(snap, node_id, mig):
        _release_lock(ctx, pod, token)
        result.waiting.append(pod.id)
        return True
    node = next(n for n in snap.by_name.values() if n.id == node_id)
    placement = Placement(node.name, {int(i): m for i, m in gpu_milli.items()}, mig)
    binds.append((pod, Decision(pod.id, placement, None)))
    return True


def _mig_free(snap: Snapshot, node_id: str, mig: dict[int, tuple[str, int]]) -> bool:
    """A MIG reservation's slices are free of the active pods' instances (its victims')."""
    if not mig:
        return True
    node = next(n for n in snap.by_name.values() if n.id == node_id)
    wanted = [MigHeld(index, profile, slot) for index, (profile, slot) in mig.items()]
    return slots_free(node.gpus, snap.mig.get(node_id, []), wanted)


def _read_cluster(ctx: ServiceContext, cache: SnapshotCache | None
                  ) -> tuple[Snapshot, Ledger, dict[str, str], backfill.GangReservation | None]:
    """What a pass plans on, in one read (a consistent snapshot; no write lock, no fence:
    the binds that act on it are fenced): the nodes, the quota ledger (the nodes' GPU
    models from the snapshot, not read again), the projects' names when some project has
    a quota (only an over-quota message needs them) and the head gang's reservation."""
    now = ctx.clock.now()
    with ctx.db.read() as session:
        snap = snapshot_in(session, now, cache)
        node_gpus = [(n.id, n.gpus) for n in snap.by_name.values()]
        ledger = quotas.load_ledger(session, now, node_gpus, snap.holdings)
        names = quotas.project_names(session) if ledger.quotas else {}
        held = backfill.head_reservation_in(session, now, snap.nodes)
    return snap, ledger, names, held


def _fair_order(pods: list[LeasedPod], ledger: Ledger,
                nodes: list[NodeState]) -> list[LeasedPod]:
    """Priority first; among equals, the project with the smallest dominant share (DRF),
    then the lease order (oldest first)."""
    capacity = drf_capacity(nodes)
    shares = {p.project_id: ledger.dominant_share(p.project_id, capacity) for p in pods}
    order = {p.id: i for i, p in enumerate(pods)}
    return sorted(pods, key=lambda p: (-p.priority, shares[p.project_id], order[p.id]))


def admit(ledger: Ledger, names: dict[str, str], pods: list[LeasedPod],
          capacity: dict[str, int]) -> tuple[list[LeasedPod], list[tuple[LeasedPod, str]]]:
    """The pods within their project's quota and borrow limit (each admitted one counts
    for the next), and the others with the reason."""
    admitted: list[LeasedPod] = []
    over: list[tuple[LeasedPod, str]] = []
    for pod in pods:
        milli = round(pod.gpus * FULL_GPU_MILLI)
        model = quota_model(ledger, pod.project_id, pod.gpu_type, milli, capacity)
        if milli == 0 or model is None or ledger.admits(pod.project_id, model, milli):
            if model is not None:
                ledger.add(pod.project_id, model, milli)
            admitted.append(pod)
        else:
            name = names.get(pod.project_id, pod.project_id)
            over.append((pod, ledger.over_quota_message(pod.project_id, name, model, milli)))
    return admitted, over


def quota_model(ledger: Ledger, project: str, gpu_type: str | None, milli: int,
                capacity: dict[str, int]) -> str | None:
    """The model a request counts against: its own, else the cluster's model that suits
    the project best (within quota, then admitted); None for a cluster with no GPUs."""
    if gpu_type is not None:
        return canonical_name(gpu_type)
    models = sorted(capacity)
    return min(models, default=None, key=lambda m: (
        ledger.would_borrow(project, m, milli), not ledger.admits(project, m, milli), m))


#: Pods bound per transaction, each chunk committed before the next is written: a chunk
#: holds its nodes' rows (their claim) until its commit, and a pod report or a full-path
#: renewal of those nodes waits that long. 1,000 held them about 1 s (bench/lease_vs_bind.py:
#: renewal p99 0.7-1.4 s during a drain, 0.13 s at 100) and bench/fleet.py found healthy
#: nodes falsely Lost in every drain at 1,000 (10-251 of 1,000 in 7 runs) and none in 4
#: runs at 100, at about 0.7x the drain rate (docs/replicas.md). ``GPUCLOUD_BIND_CHUNK``
#: overrides it (1-1,000: a chunk's (id, version) pairs stay well under SQLite's 32,766
#: parameters).
_BIND_CHUNK = number_from_env("GPUCLOUD_BIND_CHUNK", 100, 1, 1000)


def bind_all(ctx: ServiceContext, token: str, binds: list[tuple[LeasedPod, Decision]],
             nodes: dict[str, NodeModel], node_versions: dict[str, int],
             announce: Announce = notify_nodes) -> tuple[list[str], list[str]]:
    """Write the pass's bindings in one transaction (per chunk) with a few statements, not
    two ORM round trips per pod; returns the pod ids bound and those in conflict.

    The guards are those of a single bind, checked per row: (1) one ``UPDATE … RETURNING``
    claims every target node on its snapshot ``version`` (still Ready, not cordoned); (2)
    one ``UPDATE … RETURNING`` takes every pod whose node was claimed on its ``version``
    and ``lock_token`` (still Pending, not deleted), bumping the version and holding the
    rows; (3) one executemany writes those pods' bindings, (4) one their events. A pod
    whose node or own row changed meanwhile is in conflict: its lock is released and the
    next pass retries it. A claimed node whose pods all conflicted keeps its bump, which
    only wakes its agent's long poll for nothing.
    """
    bound: list[str] = []
    conflicts: list[str] = []
    for start in range(0, len(binds), _BIND_CHUNK):
        chunk = binds[start:start + _BIND_CHUNK]
        done, failed = _bind_chunk(ctx, token, chunk, nodes, node_versions, announce)
        bound += done
        conflicts += failed
    return bound, conflicts


def _bind(ctx: ServiceContext, pod: LeasedPod, token: str, decision: Decision,
          nodes: dict[str, NodeModel], node_versions: dict[str, int]) -> bool:
    """Bind one pod (``bind_all`` of one): False when its node or its row changed."""
    bound, _ = bind_all(ctx, token, [(pod, decision)], nodes, node_versions)
    return bool(bound)


def _bind_chunk(ctx: ServiceContext, token: str, binds: list[tuple[LeasedPod, Decision]],
                nodes: dict[str, NodeModel], node_versions: dict[str, int],
                announce: Announce) -> tuple[list[str], list[str]]:
    now = ctx.clock.now()
    targets = {nodes[_placed_on(d)].id: node_versions[_placed_on(d)] for _, d in binds}
    with ctx.db.transaction() as session:
        connection = session.connection()
        claimed = _claim_nodes(connection, targets)
        ready = [(p, d) for p, d in binds if nodes[_placed_on(d)].id in claimed]
        if len(ready) == 1:  # a warm start's one pod: its take and binding, one UPDATE
            rows = _binding_rows(token, now, ready, nodes)
            taken = connection.execute(_TAKE_AND_BIND, {**rows[0], "b_version":
                                                        ready[0][0].version}).rowcount
            bound = ready if taken == 1 else []
        else:
            held = _take_pods(connection, token, [p for p, _ in ready])
            bound = [(p, d) for p, d in ready if p.id in held]
            rows = _binding_rows(token, now, bound, nodes)
            _write_bindings(session, token, now, rows)
        _after_bindings(session, now, bound, rows, nodes)
        done = {p.id for p, _ in bound}
        conflicts = [p.id for p, _ in binds if p.id not in done]
        if conflicts:
            connection.execute(update(_PODS).where(
                _PODS.c.id.in_(conflicts), _PODS.c.lock_token == token,
            ).values(lock_token=None, lock_expires_at=None))
    mark("scheduler.bind.committed", pods=len(bound))
    for name in {_placed_on(d) for _, d in binds if nodes[_placed_on(d)].id in claimed}:
        node_versions[name] += 1
    if claimed:  # committed (a rollback raised above): their agents may look now
        announce(sorted(claimed))
    return [p.id for p, _ in bound], conflicts


def _placed_on(decision: Decision) -> str:
    assert decision.placement is not None
    return decision.placement.node


def _claim_nodes(connection: Connection, versions: dict[str, int]) -> set[str]:
    """Guarded bump of each node on its version (see ``claim_node``): the ids claimed."""
    if not versions:
        return set()
    if len(versions) == 1:  # a warm start's one node: one row, no lock order to keep
        ((node_id, version),) = versions.items()
        return {claimed for (claimed,) in connection.execute(
            _CLAIM_ONE, {"c_id": node_id, "c_version": version})}
    pairs, params = row_sources.id_version_in(connection, _NODES.c.id, _NODES.c.version,
                                              list(versions.items()))
    guard = (pairs, _NODES.c.status == NodeStatus.READY.value, _NODES.c.cordoned.is_(False))
    # Rows locked in id order (PostgreSQL): two passes claiming overlapping nodes queue
    # instead of deadlocking.
    ordered = select(_NODES.c.id).where(*guard).order_by(_NODES.c.id).with_for_update()
    rows = connection.execute(
        update(_NODES)
        .where(_NODES.c.id.in_(ordered.scalar_subquery()), *guard)
        .values(version=_NODES.c.version + 1,
                assignments_revision=_NODES.c.assignments_revision + 1)
        .returning(_NODES.c.id), params)
    return {node_id for (node_id,) in rows}


#: ``_claim_nodes`` of one node, built once.
_CLAIM_ONE = (
    update(_NODES)
    .where(_NODES.c.id == bindparam("c_id"), _NODES.c.version == bindparam("c_version"),
           _NODES.c.status == NodeStatus.READY.value, _NODES.c.cordoned.is_(False))
    .values(version=_NODES.c.version + 1,
            assignments_revision=_NODES.c.assignments_revision + 1)
    .returning(_NODES.c.id))


def _take_pods(connection: Connection, token: str, pods: list[LeasedPod]) -> set[str]:
    """Guarded version bump of each pod still as leased: the ids taken (their rows are
    then this transaction's until it commits)."""
    if not pods:
        return set()
    pairs, params = row_sources.id_version_in(connection, _PODS.c.id, _PODS.c.version,
                                              [(p.id, p.version) for p in pods])
    guard = (pairs, _PODS.c.lock_token == token, _PODS.c.phase == PodPhase.PENDING.value,
             _PODS.c.deleted_at.is_(None))
    ordered = select(_PODS.c.id).where(*guard).order_by(_PODS.c.id).with_for_update()
    rows = connection.execute(
        update(_PODS)
        .where(_PODS.c.id.in_(ordered.scalar_subquery()), *guard)
        .values(version=_PODS.c.version + 1)
        .returning(_PODS.c.id), params)
    return {pod_id for (pod_id,) in rows}


#: What every binding sets alike (the per-pod values come from its row).
_BOUND = update(_PODS).where(_PODS.c.lock_token == bindparam("b_token")).values(
    phase=PodPhase.SCHEDULED.value, mig_device=None, attempt=_PODS.c.attempt + 1,
    log_tail=None, reason="Scheduled", unschedulable=None, updated_at=bindparam("b_now"),
    nominated_node_id=None, nominated_gpu_milli=None, nominated_until=None,
    lock_token=None, lock_expires_at=None)
#: One statement per binding (an executemany: SQLite) …
_WRITE_BINDING = _BOUND.where(_PODS.c.id == bindparam("b_id")).values(
    node_id=bindparam("b_node_id"), gpu_uuids=bindparam("b_gpu_uuids"),
    mig_slot=bindparam("b_mig_slot"), gpu_milli=bindparam("b_gpu_milli"),
    volume_node_id=bindparam("b_volume_node_id"), message=bindparam("b_message"))
#: … or one for a whole chunk, its rows as arrays (PostgreSQL: ``row_sources``).
_WRITE_BINDINGS = row_sources.bindings_update(_BOUND, _PODS.c.id)


#: A single binding with its pod's guards (``_take_pods`` of one: still as leased, on
#: its version): the take and the write in one statement, 0 rows when it changed.
_TAKE_AND_BIND = _WRITE_BINDING.where(
    _PODS.c.version == bindparam("b_version"), _PODS.c.phase == PodPhase.PENDING.value,
    _PODS.c.deleted_at.is_(None)).values(version=_PODS.c.version + 1)


def _binding_rows(token: str, now: datetime, bound: list[tuple[LeasedPod, Decision]],
                  nodes: dict[str, NodeModel]) -> list[dict[str, Any]]:
    """The parameters of each binding's UPDATE (``_WRITE_BINDING``)."""
    rows = []
    for pod, decision in bound:
        assert decision.placement is not None
        node = nodes[decision.placement.node]
        gpu_by_index = {g["index"]: g["uuid"] for g in node.gpus}
        gpu_milli = {str(i): m for i, m in sorted(decision.placement.gpu_milli.items())}
        rows.append({
            "b_id": pod.id, "b_token": token, "b_node_id": node.id,
            "b_gpu_uuids": [gpu_by_index[int(i)] for i in gpu_milli],
            "b_mig_slot": _mig_slot(decision.placement), "b_gpu_milli": gpu_milli,
            "b_volume_node_id": node.id if pod.volume_bytes is not None else None,
            "b_message": f"bound to {node.name}", "b_now": now})
    return rows


def _write_bindings(session: Session, token: str, now: datetime,
                    rows: list[dict[str, Any]]) -> None:
    """The taken pods' bindings (one executemany, or one statement on PostgreSQL)."""
    if not rows:
        return
    written = _write_rows(session.connection(), token, now, rows)
    if written != len(rows):  # the rows are held since _take_pods: cannot happen
        raise RuntimeError(f"bound {written} of {len(rows)} taken pods")


def _after_bindings(session: Session, now: datetime, bound: list[tuple[LeasedPod, Decision]],
                    rows: list[dict[str, Any]], nodes: dict[str, NodeModel]) -> None:
    """What follows the bound pods' bindings: volume moves, their Scheduled events."""
    if not bound:
        return
    for pod, decision in bound:
        if pod.volume_bytes is not None:
            migration.on_bind(session, pod.id, nodes[_placed_on(decision)].id)
    record_events(session, [
        {"pod_id": row["b_id"], "time": now, "reason": "Scheduled",
         "message": row["b_message"], "from_phase": PodPhase.PENDING.value,
         "to_phase": PodPhase.SCHEDULED.value} for row in rows])


def _write_rows(connection: Connection, token: str, now: datetime,
                rows: list[dict[str, Any]]) -> int:
    """The bindings' UPDATEs: one with arrays on PostgreSQL, else an executemany."""
    if not row_sources.arrays(connection):
        return connection.execute(_WRITE_BINDING, rows).rowcount
    columns = {name: [row[f"b_{name}"] for row in rows]
               for name, _ in row_sources.BINDING_COLUMNS}
    columns["gpu_uuids"] = [json.dumps(value) for value in columns["gpu_uuids"]]
    columns["gpu_milli"] = [json.dumps(value) for value in columns["gpu_milli"]]
    params = {f"b_{name}": values for name, values in columns.items()}
    return connection.execute(_WRITE_BINDINGS, {**params, "b_token": token,
                                                "b_now": now}).rowcount


def _mig_slot(placement: Placement) -> int | None:
    """The start slot the scheduler chose for a MIG placement (None: not MIG)."""
    return next((start for _, start in placement.mig.values()), None)


def claim_node(session: Session, node_id: str, version: int) -> bool:
    """Guarded bump of the node: fails if it changed (cordoned, lost, re-registered).
    Its agent's long poll wakes once the binding commits."""
    claimed = bool(rows_changed(
        session,
        update(NodeModel)
        .where(NodeModel.id == node_id, NodeModel.version == version,
               NodeModel.status == NodeStatus.READY.value, NodeModel.cordoned.is_(False))
        .values(version=NodeModel.version + 1,
                assignments_revision=NodeModel.assignments_revision + 1),
    ))
    if claimed:
        on_commit(session, partial(wakeups.ASSIGNMENTS.notify, node_id))
    return claimed


def retry_unschedulable(session: Session) -> None:
    """Capacity may have appeared: once ``session`` commits, the next pass looks at
    unschedulable pods and jobs again (coalesced: services/capacity.py)."""
    on_commit(session, capacity.CAPACITY.mark)


def retry_marked(ctx: ServiceContext) -> bool:
    """Clear the unschedulable pods' and jobs' back-off if capacity appeared since the
    last pass (``retry_unschedulable``): one transaction for all the changes that came
    meanwhile. The mark stays when it fails (the database away), for the next pass."""
    if not capacity.CAPACITY.take():
        return False
    try:
        with ctx.db.transaction() as session:
            connection = session.connection()
            connection.execute(_RETRY_PODS)
            connection.execute(_RETRY_JOBS)
    except BaseException:
        capacity.CAPACITY.mark_local()
        raise
    return True


_JOBS = Base.metadata.tables[JobModel.__tablename__]
_RETRY_PODS = (update(_PODS)
               .where(_PODS.c.phase == PodPhase.PENDING.value,
                      _PODS.c.reason == "Unschedulable", _PODS.c.not_before.is_not(None))
               .values(not_before=None))
_RETRY_JOBS = (update(_JOBS)
               .where(_JOBS.c.gang_state == "queued", _JOBS.c.reason == "Unschedulable",
                      _JOBS.c.not_before.is_not(None))
               .values(not_before=None))


def _release_lock(ctx: ServiceContext, pod: LeasedPod, token: str) -> None:
    with ctx.db.transaction() as session:
        _release(session, pod, token)


def _mark_over_quota(ctx: ServiceContext, token: str,
                     over: list[tuple[LeasedPod, str]]) -> None:
    """Keep over-quota pods Pending with the reason; an event when it is new."""
    if not over:
        return  # no write transaction (SQLite's write lock, the leader's fence) for nothing
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        for pod, message in over:
            changed = rows_changed(session, update(PodModel).where(
                PodModel.id == pod.id, PodModel.lock_token == token,
                PodModel.version == pod.version, PodModel.message.is_distinct_from(message),
            ).values(reason=OVER_QUOTA, message=message, unschedulable=None,
                     updated_at=now))
            if changed:
                record_event(session, pod.id, now, OVER_QUOTA, message)
            _release(session, pod, token)
            session.execute(update(PodModel).where(PodModel.id == pod.id).values(
                not_before=now + timedelta(seconds=UNSCHEDULABLE_RETRY_SECONDS)))


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
