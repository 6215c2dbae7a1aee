"""Admission under a project's spend limit and prepaid credit (see ``services.spend``).

Imported by ``services.pods``: it reads the meter's table (``PodRunModel``) itself for a
prepaid balance instead of going through ``services.usage``, whose import of
``services.nodes`` imports ``services.pods`` again. Only what pricing needs is read
(allocations and times, not the samples' averages).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import Executable, or_, select
from sqlalchemy.orm import Session

from gpucloud.core.billing import (
    GIB,
    SECONDS_PER_HOUR,
    SECONDS_PER_MONTH,
    PriceClass,
    Resource,
    from_micros,
)
from gpucloud.core.errors import Conflict
from gpucloud.core.gpu_models import canonical_name
from gpucloud.core.phases import ACTIVE_PHASE_VALUES, PodPhase
from gpucloud.db.models import NodeModel, PodModel, PodRunModel, SpendLimitModel
from gpucloud.services import prices
from gpucloud.services.charges import cost_of
from gpucloud.services.context import ServiceContext
from gpucloud.services.prices import PriceBook
from gpucloud.services.projects import Principal

CACHE_PREFIX = "spend-limit:"
ADMITTED = (PodPhase.PENDING.value, *ACTIVE_PHASE_VALUES)
#: The volume price is per 30-day month; a rate per hour divides by its hours.
_HOURS_PER_MONTH = Decimal(SECONDS_PER_MONTH) / SECONDS_PER_HOUR
_INSTANT = timedelta(microseconds=1)


def spent(session: Session, book: PriceBook, project_id: str, since: datetime,
          now: datetime) -> Decimal:
    """The net cost of the project's metered runs over [since, now)."""
    if since >= now:
        return Decimal(0)
    runs = session.scalars(select(PodRunModel).where(
        PodRunModel.project_id == project_id, PodRunModel.started_at < now,
        or_(PodRunModel.ended_at.is_(None), PodRunModel.ended_at > since))).all()
    return cost_of(book, runs, since, now)


def balance(session: Session, book: PriceBook, limit: SpendLimitModel,
            now: datetime) -> Decimal | None:
    """What is left of the prepaid credit (None: the project has none)."""
    if limit.credit_micros is None or limit.credit_since is None:
        return None
    return from_micros(limit.credit_micros) - spent(session, book, limit.project_id,
                                                     limit.credit_since, now)


# --- rates -------------------------------------------------------------------------------


def _price_now(segments: list[prices.Segment]) -> Decimal:
    return segments[0].price if segments else Decimal(0)


def dearest_model(session: Session, book: PriceBook, price_class: PriceClass,
                  now: datetime) -> str:
    """The model a pod that names none may land on at the highest price."""
    models = sorted(prices.known_models(session))
    return max(models, key=lambda m: _price_now(book.gpu(m, None, price_class, now,
                                                         now + _INSTANT)))


def hourly_rate(book: PriceBook, now: datetime, gpus: float, model: str | None, spot_: bool,
                cpu_milli: int, volume_bytes: int | None) -> Decimal:
    """What a pod with this allocation costs per hour at ``now``."""
    cls = PriceClass.SPOT if spot_ else PriceClass.ON_DEMAND
    end = now + _INSTANT
    if gpus > 0:
        rate = Decimal(str(gpus)) * _price_now(book.gpu(model or "", None, cls, now, end))
    else:
        rate = Decimal(cpu_milli) / 1000 * _price_now(book.flat(Resource.CPU, cls, now, end))
    if volume_bytes:
        per_month = _price_now(book.flat(Resource.VOLUME, cls, now, end))
        rate += Decimal(volume_bytes) / GIB * per_month / _HOURS_PER_MONTH
    return rate


def _node_models(session: Session) -> dict[tuple[str, int], str]:
    return {(node_id, int(gpu["index"])): canonical_name(str(gpu.get("model", "")))
            for node_id, gpus in session.execute(select(NodeModel.id, NodeModel.gpus))
            for gpu in gpus if "index" in gpu}


def _model_of(pod: PodModel, node_models: dict[tuple[str, int], str],
              fallback: dict[bool, str]) -> str:
    """The model a pod pays for: where it runs, else what it asks for, else the dearest."""
    if pod.node_id and pod.gpu_milli:
        index = int(next(iter(pod.gpu_milli)))
        placed = node_models.get((pod.node_id, index))
        if placed:
            return placed
    if pod.gpu_type:
        return canonical_name(pod.gpu_type)
    return fallback[bool(pod.spot)]


def _fallbacks(session: Session, book: PriceBook, now: datetime) -> dict[bool, str]:
    return {spot_: dearest_model(session, book, PriceClass.SPOT if spot_ else
                                 PriceClass.ON_DEMAND, now) for spot_ in (False, True)}


def reserved_per_hour(session: Session, book: PriceBook, project_id: str,
                      now: datetime) -> Decimal:
    """The hourly rate of the project's admitted pods (Pending to Running)."""
    pods = session.scalars(select(PodModel).where(
        PodModel.project_id == project_id, PodModel.deleted_at.is_(None),
        PodModel.phase.in_(ADMITTED))).all()
    if not pods:
        return Decimal(0)
    node_models, fallback = _node_models(session), _fallbacks(session, book, now)
    return sum((hourly_rate(book, now, p.gpus, _model_of(p, node_models, fallback), p.spot,
                            p.cpu_milli, p.volume_bytes) for p in pods), Decimal(0))


# --- admission ---------------------------------------------------------------------------


def is_limited(ctx: ServiceContext, project_id: str) -> bool:
    """Whether the project has a limit or a credit (cached a few seconds: the hot path of
    pod creation pays no query for the projects that have neither)."""
    cached = ctx.cache.get(CACHE_PREFIX + project_id)
    if isinstance(cached, bool):
        return cached
    with ctx.db.read() as session:
        limit = session.get(SpendLimitModel, project_id)
        limited = limit is not None and (limit.per_hour_micros is not None
                                         or limit.credit_micros is not None)
    ctx.cache.put(CACHE_PREFIX + project_id, limited)
    return limited


def admit_and_insert(ctx: ServiceContext, caller: Principal, row: dict[str, Any],
                     insert: Executable) -> bool:
    """Insert the pod ``row`` if the project's limit and credit allow it, in the same
    transaction as the check; False (nothing done) for a project with neither, whose
    caller inserts it on the fast path."""
    if not is_limited(ctx, caller.project_id):
        return False
    with ctx.db.transaction() as session:
        admit(ctx, session, caller, [row])
        session.execute(insert, row)
    return True


def admit(ctx: ServiceContext, session: Session, caller: Principal,
          rows: list[dict[str, Any]]) -> None:
    """Check that the project may add all of ``rows`` (pod columns: ``gpus``,
    ``gpu_type``, ``spot``, ``cpu_milli``, ``volume_bytes``) at once — a job's members
    are admitted all or none. Holds the project's limit row (FOR UPDATE) until the
    caller's transaction, which inserts them, ends; nothing to check (or lock) for a
    project with neither a limit nor a credit."""
    if not rows or not is_limited(ctx, caller.project_id):
        return
    limit = session.get(SpendLimitModel, caller.project_id, with_for_update=True)
    if limit is not None:
        _check(session, caller, limit, rows, ctx.clock.now())


def _check(session: Session, caller: Principal, limit: SpendLimitModel,
           rows: list[dict[str, Any]], now: datetime) -> None:
    book = prices.load_book(session)
    left = balance(session, book, limit, now)
    if left is not None and left <= 0:
        raise Conflict(f"prepaid credit exhausted: project {caller.project_name!r} has a "
                       f"balance of ${left:.2f}; an admin adds credit with "
                       "`gpucloud project limit set PROJECT --credit AMOUNT`")
    if limit.per_hour_micros is None:
        return
    fallback = _fallbacks(session, book, now)
    models = [canonical_name(row["gpu_type"]) if row.get("gpu_type") else fallback[
        bool(row.get("spot"))] for row in rows]
    need = sum((hourly_rate(book, now, float(row["gpus"]), model, bool(row.get("spot")),
                            int(row["cpu_milli"]), row.get("volume_bytes"))
                for row, model in zip(rows, models, strict=True)), Decimal(0))
    reserved = reserved_per_hour(session, book, caller.project_id, now)
    cap = from_micros(limit.per_hour_micros)
    if reserved + need > cap:
        what = _what(rows[0], models[0])
        if len(rows) > 1:
            what = f"{len(rows)} members × {what}"
        raise Conflict(
            f"spend limit: project {caller.project_name!r} may spend ${cap:.2f}/h; its "
            f"admitted pods reserve ${reserved:.2f}/h and this "
            f"{'job' if len(rows) > 1 else 'pod'} needs ${need:.2f}/h "
            f"({what}); stop a pod or ask an admin to raise the limit "
            "(gpucloud project limit set)")


def _what(row: dict[str, Any], model: str) -> str:
    if float(row["gpus"]) > 0:
        kind = "spot" if row.get("spot") else "on-demand"
        return f"{float(row['gpus']):g} × {model} {kind}"
    return f"{int(row['cpu_milli']) / 1000:g} CPU cores"
