"""δ, M and τ of a pod: the checkpoint interval the server puts on its assignment and
``pod get`` shows (the formulas and estimators are ``core.checkpoint_interval``).

* δ: the ``cost_seconds`` of the pod's last committed checkpoints (median).
* M: from the pod event history of every pod of the same priority class on nodes of the
  same pool (node label ``pool``, else ``default``): the running time they accumulated
  (``Running`` to the next phase, on the node named by the ``Scheduled`` event before it)
  and the unannounced interruptions among it (``NodeLost``; a preemption comes with a
  notice and its own checkpoint, so ``Preempted`` does not count). The history read is
  the last ``WINDOW`` and the result is cached for the context cache's TTL.
* A job's member divides M by the gang's size.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import bindparam, func, or_, select
from sqlalchemy.orm import Session

from gpucloud.core.capabilities import CHECKPOINT_TRANSPARENT
from gpucloud.core.checkpoint_interval import (
    COST_SAMPLES,
    DEFAULT_CHECKPOINT_SIGNAL,
    IntervalPlan,
    plan_interval,
)
from gpucloud.core.models import AssignmentOut, PodOut
from gpucloud.core.phases import PodPhase
from gpucloud.db.models import CheckpointModel, NodeModel, PodEventModel, PodModel
from gpucloud.services.checkpoint_index import NodeCheckpoints
from gpucloud.services.context import ServiceContext

#: Interruptions nobody announced (the pod had no chance to checkpoint first).
UNANNOUNCED_REASONS = ("NodeLost",)
DEFAULT_POOL = "default"
DEFAULT_CLASS = "default"
POOL_LABEL = "pool"
WINDOW = timedelta(days=30)
_BOUND = re.compile(r"^bound to ([a-z0-9][a-z0-9-]*)")
_RUNNING = PodPhase.RUNNING.value
_CACHE_KEY = "interruption-stats"

Stats = dict[tuple[str, str], tuple[float, int]]


@dataclass
class _Walk:
    """One pod's history being walked: where it is, since when it runs."""

    pod_class: str
    node: str | None = None
    running_since: datetime | None = None


def wants_interval(pod: PodModel) -> bool:
    """Pods that checkpoint: a checkpoint dir, or transparent checkpoints."""
    return pod.checkpoint_dir is not None or pod.checkpoint_mode == CHECKPOINT_TRANSPARENT


def signal_of(pod: PodModel) -> str:
    return pod.checkpoint_signal or DEFAULT_CHECKPOINT_SIGNAL


def plan_for(ctx: ServiceContext, session: Session, pod: PodModel) -> IntervalPlan | None:
    """δ, M and τ for ``pod``; None when it does not checkpoint."""
    if not wants_interval(pod):
        return None
    return _plan(ctx, pod, interruption_stats(ctx, session), _pool_of(session, pod.node_id),
                 _costs(session, pod), _gang_size(session, pod))


def plans_for(ctx: ServiceContext, session: Session, node: NodeModel,
              pods: Iterable[PodModel], checkpoints: NodeCheckpoints,
              ) -> dict[str, IntervalPlan]:
    """``plan_for`` of each of the node's ``pods`` that checkpoint, by pod id: their
    costs from ``checkpoints`` (already read), their gangs' sizes in one query."""
    wanting = [pod for pod in pods if wants_interval(pod)]
    if not wanting:
        return {}
    stats = interruption_stats(ctx, session)
    pool = _label_pool(node.labels)
    sizes = _gang_sizes(session, {pod.job_id for pod in wanting if pod.job_id is not None})
    return {pod.id: _plan(ctx, pod, stats, pool, checkpoints.costs(pod),
                          sizes.get(pod.job_id, 1) if pod.job_id is not None else 1)
            for pod in wanting}


def _plan(ctx: ServiceContext, pod: PodModel, stats: Stats, pool: str, costs: list[float],
          members: int) -> IntervalPlan:
    exposure, interruptions = stats.get((pod.priority_class or DEFAULT_CLASS, pool),
                                        (0.0, 0))
    settings = ctx.settings
    return plan_interval(
        costs, exposure, interruptions, members=members,
        default_cost=settings.checkpoint_cost_default_seconds,
        prior_mtbf=settings.interruption_prior_mtbf_seconds,
        min_interval=settings.checkpoint_interval_min_seconds,
        max_interval=settings.checkpoint_interval_max_seconds)


def _costs(session: Session, pod: PodModel) -> list[float]:
    """The measured costs of the pod's last checkpoints, oldest first."""
    rows = session.scalars(
        select(CheckpointModel.cost_seconds)
        .where(CheckpointModel.pod_id == pod.id, CheckpointModel.cost_seconds.is_not(None))
        .order_by(CheckpointModel.created_at.desc()).limit(COST_SAMPLES)).all()
    return [float(cost) for cost in reversed(rows) if cost is not None]


def _gang_size(session: Session, pod: PodModel) -> int:
    if pod.job_id is None:
        return 1
    return int(session.scalar(select(func.count()).select_from(PodModel)
                              .where(PodModel.job_id == pod.job_id)) or 1)


def _gang_sizes(session: Session, job_ids: set[str]) -> dict[str, int]:
    if not job_ids:
        return {}
    return {str(job_id): int(count) for job_id, count in session.execute(
        _GANG_SIZES, {"jobs": sorted(job_ids)})}


#: ``_gang_sizes``' query, built once.
_GANG_SIZES = (select(PodModel.job_id, func.count())
               .where(PodModel.job_id.in_(bindparam("jobs", expanding=True)))
               .group_by(PodModel.job_id))


def _pool_of(session: Session, node_id: str | None) -> str:
    if node_id is None:
        return DEFAULT_POOL
    node = session.get(NodeModel, node_id)
    return _label_pool(node.labels) if node is not None else DEFAULT_POOL


def _label_pool(labels: dict[str, str] | None) -> str:
    return (labels or {}).get(POOL_LABEL) or DEFAULT_POOL


def interruption_stats(ctx: ServiceContext, session: Session) -> Stats:
    """(priority class, pool) → (running seconds, unannounced interruptions), cached."""
    cached = ctx.cache.get(_CACHE_KEY)
    if isinstance(cached, dict):
        return cached
    stats = compute_stats(session, ctx.clock.now())
    ctx.cache.put(_CACHE_KEY, stats)
    return stats


def compute_stats(session: Session, now: datetime) -> Stats:
    """Walk the window's events of every pod (see the module docstring)."""
    pools = {name: _label_pool(labels)
             for name, labels in session.execute(select(NodeModel.name, NodeModel.labels))}
    rows = session.execute(
        select(PodEventModel.pod_id, PodEventModel.time, PodEventModel.from_phase,
               PodEventModel.to_phase, PodEventModel.reason, PodEventModel.message,
               PodModel.priority_class)
        .join(PodModel, PodModel.id == PodEventModel.pod_id)
        .where(PodEventModel.time >= now - WINDOW, or_(
            PodEventModel.reason == "Scheduled", PodEventModel.to_phase == _RUNNING,
            PodEventModel.from_phase == _RUNNING,
            PodEventModel.reason.in_(UNANNOUNCED_REASONS)))
        .order_by(PodEventModel.pod_id, PodEventModel.time, PodEventModel.id)).all()
    exposure: dict[tuple[str, str], float] = defaultdict(float)
    counts: dict[tuple[str, str], int] = defaultdict(int)
    walks: dict[str, _Walk] = {}
    for pod_id, time, from_phase, to_phase, reason, message, pod_class in rows:
        walk = walks.setdefault(pod_id, _Walk(pod_class or DEFAULT_CLASS))
        key = (walk.pod_class, pools.get(walk.node or "", DEFAULT_POOL))
        if reason == "Scheduled":
            match = _BOUND.match(message or "")
            walk.node = match.group(1) if match else None
        if reason in UNANNOUNCED_REASONS:
            counts[key] += 1
        if walk.running_since is not None and from_phase == _RUNNING and to_phase != _RUNNING:
            exposure[key] += (time - walk.running_since).total_seconds()
            walk.running_since = None
        elif to_phase == _RUNNING and walk.running_since is None:
            walk.running_since = time
    for walk in walks.values():
        if walk.running_since is not None:
            key = (walk.pod_class, pools.get(walk.node or "", DEFAULT_POOL))
            exposure[key] += max(0.0, (now - walk.running_since).total_seconds())
    return {key: (exposure.get(key, 0.0), counts.get(key, 0))
            for key in set(exposure) | set(counts)}


def add_to_pod_out(ctx: ServiceContext, session: Session, pod: PodModel, out: PodOut) -> None:
    """``pod get``: δ, M and τ of a pod that checkpoints."""
    plan = plan_for(ctx, session, pod)
    if plan is not None:
        out.checkpoint_cost_seconds = round(plan.cost_seconds, 3)
        out.interruption_mtbf_seconds = round(plan.mtbf_seconds, 3)
        out.checkpoint_interval_seconds = round(plan.interval_seconds, 3)


def add_to_assignment(pod: PodModel, assignment: AssignmentOut,
                      plan: IntervalPlan | None) -> None:
    """The periodic checkpoint request (τ and the signal, from ``plans_for``) and the
    checkpoint mode."""
    if plan is not None:
        assignment.checkpoint_interval_seconds = plan.interval_seconds
        assignment.checkpoint_signal = signal_of(pod)
    assignment.checkpoint_mode = pod.checkpoint_mode
