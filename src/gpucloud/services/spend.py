"""Spend limits and prepaid credit per project (admission itself: services.admission).

- **Limit per hour** (RunPod's default is $80/h; here none until an admin sets one): a pod
  is admitted only when the hourly rate of the project's admitted pods (Pending to
  Running, not ended), its own included, stays within the limit. The check and the
  pod's INSERT are one transaction holding the project's limit row, so concurrent creates
  cannot both take the last dollars. A pod's rate is its GPUs × the price of its model
  and class now (the node's model once placed; the dearest model the cluster has when it
  names none), or its cores × the CPU price, plus its volume disk.
- **Prepaid credit**: the balance is the credit less the cost of usage since it was set.
  No pod is admitted while it is spent; when it runs out, the project's pods are stopped
  with a notice (reason ``credit``: SIGTERM, SIGKILL after the grace) and not requeued.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.core.billing import (
    SpendLimitOut,
    SpendLimitSetRequest,
    from_micros,
    round_money,
    to_micros,
)
from gpucloud.core.errors import NotFound
from gpucloud.core.phases import ACTIVE_PHASES, PodPhase
from gpucloud.core.spot import StopNotice, StopReason
from gpucloud.db.models import PodModel, ProjectModel, SpendLimitModel
from gpucloud.services import billing, prices, spot
from gpucloud.services.admission import ADMITTED, balance, reserved_per_hour
from gpucloud.services.context import ServiceContext
from gpucloud.services.events import record_event, transition
from gpucloud.services.pods import bump_assignments
from gpucloud.services.projects import Principal

CREDIT_EXHAUSTED = "CreditExhausted"


def _find_project(session: Session, ref: str) -> ProjectModel:
    row = session.scalar(select(ProjectModel).where(
        (ProjectModel.name == ref) | (ProjectModel.id == ref)))
    if row is None:
        raise NotFound(f"project {ref!r} not found")
    return row


def set_limit(ctx: ServiceContext, caller: Principal, project: str,
              request: SpendLimitSetRequest) -> SpendLimitOut:
    """Set (or, with null, clear) the fields given (admin). A credit restarts the
    balance: usage from now on is spent from it."""
    caller.require_admin()
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        row = _find_project(session, project)
        limit = session.get(SpendLimitModel, row.id, with_for_update=True)
        if limit is None:
            limit = SpendLimitModel(project_id=row.id, version=0)
            session.add(limit)
        if "per_hour" in request.model_fields_set:
            limit.per_hour_micros = None if request.per_hour is None else to_micros(
                request.per_hour)
        if "credit" in request.model_fields_set:
            limit.credit_micros = None if request.credit is None else to_micros(request.credit)
            limit.credit_since = None if request.credit is None else now
            limit.exhausted_at = None
        limit.updated_at = now
        limit.version = (limit.version or 0) + 1
        session.flush()
        out = _out(session, row, limit, now)
    ctx.cache.clear()  # admission reads "is it limited" from the cache
    return out


def get_limit(ctx: ServiceContext, caller: Principal, project: str | None) -> SpendLimitOut:
    now = ctx.clock.now()
    with ctx.db.read() as session:
        row = billing._project(session, caller, project)  # noqa: SLF001 - one visibility rule
        return _out(session, row, session.get(SpendLimitModel, row.id), now)


def _out(session: Session, project: ProjectModel, limit: SpendLimitModel | None,
         now: datetime) -> SpendLimitOut:
    book = prices.load_book(session)
    reserved = reserved_per_hour(session, book, project.id, now)
    out = SpendLimitOut(project=project.name, reserved_per_hour=round_money(reserved))
    if limit is None:
        return out
    out.updated_at = limit.updated_at
    if limit.per_hour_micros is not None:
        out.per_hour = from_micros(limit.per_hour_micros)
    left = balance(session, book, limit, now)
    if left is not None and limit.credit_micros is not None:
        out.credit, out.credit_since = from_micros(limit.credit_micros), limit.credit_since
        out.spent_since_credit, out.balance = from_micros(limit.credit_micros) - left, left
    return out


# --- prepaid credit ----------------------------------------------------------------------


def enforce_credit(ctx: ServiceContext) -> list[str]:
    """Stop, with a notice, the pods of projects whose prepaid balance ran out; returns
    the names of the pods stopped."""
    now = ctx.clock.now()
    with ctx.db.read() as session:
        ids = list(session.scalars(select(SpendLimitModel.project_id).where(
            SpendLimitModel.credit_micros.is_not(None),
            SpendLimitModel.exhausted_at.is_(None))))
    stopped: list[str] = []
    for project_id in ids:
        stopped.extend(_exhaust_if_spent(ctx, project_id, now))
    if ids:
        ctx.cache.clear()
    return stopped


def _exhaust_if_spent(ctx: ServiceContext, project_id: str, now: datetime) -> list[str]:
    with ctx.db.transaction() as session:
        limit = session.get(SpendLimitModel, project_id, with_for_update=True)
        if (limit is None or limit.credit_micros is None or limit.credit_since is None
                or limit.exhausted_at is not None):
            return []
        left = balance(session, prices.load_book(session), limit, now)
        if left is None or left > 0:
            return []
        limit.exhausted_at, limit.version = now, limit.version + 1
        why = (f"the project's prepaid credit of ${from_micros(limit.credit_micros):.2f} "
               f"is spent (balance ${left:.2f})")
        return [_stop(ctx, session, pod, why, now) for pod in _live_pods(session, project_id)]


def _live_pods(session: Session, project_id: str) -> list[PodModel]:
    return list(session.scalars(select(PodModel).where(
        PodModel.project_id == project_id, PodModel.deleted_at.is_(None),
        PodModel.phase.in_(ADMITTED), PodModel.desired_state == "running")))


def _stop(ctx: ServiceContext, session: Session, pod: PodModel, why: str,
          now: datetime) -> str:
    """A Pending pod ends at once; a placed one is stopped with a notice (not counted as
    a preemption: nothing took its place)."""
    if PodPhase(pod.phase) not in ACTIVE_PHASES:
        transition(session, pod, PodPhase.STOPPED, now, CREDIT_EXHAUSTED, why)
        pod.desired_state, pod.finished_at = "stopped", now
        return pod.name
    grace = spot.grace_of(ctx, pod)
    notice = StopNotice(reason=StopReason.CREDIT, deadline=now + timedelta(seconds=grace),
                        attempt=pod.attempt, grace_seconds=grace)
    pod.stop_notice = notice.model_dump(mode="json")
    pod.stop_grace_seconds = grace
    pod.desired_state = "stopped"
    pod.version += 1
    record_event(session, pod.id, now, CREDIT_EXHAUSTED, why)
    record_event(session, pod.id, now, spot.NOTICE, f"reason {StopReason.CREDIT.value}, "
                 f"attempt {pod.attempt}, SIGKILL after {grace:g}s")
    bump_assignments(session, pod.node_id)
    return pod.name
