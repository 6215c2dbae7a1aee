"""Billing: the meter's runs priced into usage rows and invoices, exactly.

The meter (``services.usage.pod_runs``) gives one run per pod attempt's ``Running``
interval; its start and end decide the billed seconds (so image pulls are never billed,
the stop grace is, and a run on a node later declared Lost ends at its last lease
renewal). A run is clipped to the period asked for, split where a price changes and at
UTC midnight, and each piece is priced:

- GPUs by allocation: whole GPUs, a share (milli-GPU / 1000) or MIG instances (their own
  price, else slices/7 of the GPU's), × seconds × the price per GPU-hour of its model and
  class (spot or on-demand);
- a CPU-only pod: its cores × seconds × the price per core-hour;
- its volume disk while it runs: GiB × seconds × the price per GiB-month / 30 days;
- a run ended by a GPU hardware fault (``GpuFault``) is credited in full.

Network volumes are billed per GiB-month for the time they exist in the period.
Amounts are exact ``Decimal``; each usage row and invoice line is rounded to the
micro-unit once, and totals are sums of those rounded figures.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from datetime import datetime, timedelta
from decimal import Decimal

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.core.billing import (
    GIB,
    SECONDS_PER_MONTH,
    UNITS,
    InvoiceLine,
    InvoiceOut,
    PriceClass,
    Resource,
    UsageBy,
    UsageOut,
    UsageRow,
    parse_month,
    round_money,
)
from gpucloud.core.errors import InvalidInput, NotFound
from gpucloud.core.gpu_models import canonical_name
from gpucloud.core.usage import PodRun
from gpucloud.db.models import PodModel, ProjectModel, VolumeModel
from gpucloud.services import usage as meter
from gpucloud.services.charges import Charge, Piece, charge, gpu_quantity, pieces, seconds_between
from gpucloud.services.context import ServiceContext
from gpucloud.services.prices import PriceBook, load_book
from gpucloud.services.projects import Principal

#: ``usage --since`` when none is given: the last 30 days.
DEFAULT_WINDOW = timedelta(days=30)


# --- usage -------------------------------------------------------------------------------


def _project(session: Session, caller: Principal, ref: str | None) -> ProjectModel:
    """The caller's project, or (admin only) the one named; others' projects are hidden."""
    if ref is None:
        return session.get_one(ProjectModel, caller.project_id)
    row = session.scalar(select(ProjectModel).where(
        (ProjectModel.name == ref) | (ProjectModel.id == ref)))
    if row is None or (not caller.is_admin and row.id != caller.project_id):
        raise NotFound(f"project {ref!r} not found")
    return row


def usage(ctx: ServiceContext, caller: Principal, project: str | None, since: datetime | None,
          until: datetime | None, by: UsageBy) -> UsageOut:
    now = ctx.clock.now()
    until = min(until or now, now)
    try:
        since = since or until - DEFAULT_WINDOW
    except OverflowError:
        raise InvalidInput("until", f"{until.isoformat()} is out of range") from None
    if since >= until:
        raise InvalidInput("since", f"{since.isoformat()} is not before {until.isoformat()}")
    with ctx.db.read() as session:
        row = _project(session, caller, project)
        book = load_book(session)
        runs = list(meter.pod_runs(session, row.id, since, until))
        names = _pod_names(session, {r.pod_id for r in runs})
    groups: dict[str, list[Piece[PodRun]]] = defaultdict(list)
    for piece in pieces(book, runs, since, until):
        groups[_group_key(piece, by)].append(piece)
    rows = [_row(key, group, by, names) for key, group in sorted(groups.items())]
    return UsageOut(project=row.name, since=since, until=until, by=by, rows=rows,
                    total_cost=sum((r.cost for r in rows), Decimal(0)))


def _pod_names(session: Session, ids: set[str]) -> dict[str, str]:
    if not ids:
        return {}
    rows = session.execute(select(PodModel.id, PodModel.name).where(PodModel.id.in_(ids)))
    return {pod_id: name for pod_id, name in rows}


def _group_key(piece: Piece[PodRun], by: UsageBy) -> str:
    run = piece.run
    if by is UsageBy.POD:
        return run.pod_id
    if by is UsageBy.JOB:
        return run.job_id or "-"
    if by is UsageBy.GPU_TYPE:
        return (canonical_name(run.gpu_type) if run.gpu_type else "-") if gpu_quantity(
            run) else "cpu-only"
    return piece.start.date().isoformat()


def _weighted(values: list[tuple[float | None, Decimal]]) -> float | None:
    known = [(v, w) for v, w in values if v is not None and w > 0]
    total = sum((w for _, w in known), Decimal(0))
    if not known or total == 0:
        return None
    return round(float(sum((Decimal(str(v)) * w for v, w in known), Decimal(0)) / total), 2)


def _cpu_seconds(group: list[Piece[PodRun]]) -> float | None:
    """Measured CPU time, spread over a run's pieces in proportion to their length."""
    parts = [Decimal(str(p.run.cpu_seconds)) * p.seconds / p.run_seconds
             for p in group if p.run.cpu_seconds is not None and p.run_seconds > 0]
    return round(float(sum(parts, Decimal(0))), 3) if parts else None


def _row(key: str, group: list[Piece[PodRun]], by: UsageBy, names: dict[str, str]) -> UsageRow:
    first = group[0].run
    utils = [(p.run.gpu_util_avg if not p.run.mig_profile else None, p.gpu_seconds)
             for p in group]
    return UsageRow(
        key=key,
        pod=names.get(first.pod_id) if by is UsageBy.POD else None,
        pod_id=first.pod_id if by is UsageBy.POD else None,
        job_id=first.job_id if by is UsageBy.JOB else None,
        gpu_type=key if by is UsageBy.GPU_TYPE else None,
        day=key if by is UsageBy.DAY else None,
        runs=len({(id(p.run)) for p in group}),
        seconds=float(sum((p.seconds for p in group), Decimal(0))),
        gpu_seconds=float(sum((p.gpu_seconds for p in group), Decimal(0))),
        cpu_core_seconds=float(sum((Decimal(p.run.cpu_milli) / 1000 * p.seconds
                                    for p in group), Decimal(0))),
        gpu_util_avg=_weighted(utils), cpu_seconds=_cpu_seconds(group),
        cost=round_money(sum((p.cost for p in group), Decimal(0))),
        credited=round_money(sum((p.credited for p in group), Decimal(0))),
    )


# --- invoices ----------------------------------------------------------------------------


def invoice(ctx: ServiceContext, caller: Principal, project: str, month: str) -> InvoiceOut:
    try:
        start, end = parse_month(month)
    except ValueError as error:
        raise InvalidInput("month", str(error)) from None
    until = min(end, ctx.clock.now())
    with ctx.db.read() as session:
        row = _project(session, caller, project)
        book = load_book(session)
        runs = list(meter.pod_runs(session, row.id, start, until)) if start < until else []
        volumes = _network_volumes(session, book, row.id, start, until)
    charges = [c for p in pieces(book, runs, start, until) for c in p.charges] + volumes
    # A credited run shows what it would have cost, and the credit that cancels it.
    charges += [replace(c, credited=False) for c in charges if c.credited]
    lines = _lines(charges)
    total_charges = sum((line.amount for line in lines if line.amount > 0), Decimal(0))
    credits = sum((line.amount for line in lines if line.amount < 0), Decimal(0))
    return InvoiceOut(project=row.name, month=month.strip(), period_start=start,
                      period_end=end, lines=lines, charges=total_charges, credits=credits,
                      total=total_charges + credits)


def _network_volumes(session: Session, book: PriceBook, project_id: str, start: datetime,
                     until: datetime) -> list[Charge]:
    """Network volumes that exist now, per GiB-month from their creation (or the period's
    start) to the period's end."""
    out: list[Charge] = []
    volumes = session.scalars(select(VolumeModel).where(VolumeModel.project_id == project_id))
    for volume in volumes:
        s = max(start, volume.created_at)
        for segment in book.flat(Resource.VOLUME, PriceClass.ON_DEMAND, s, until) if (
                s < until) else []:
            gib_months = (Decimal(volume.size_bytes) / GIB
                          * seconds_between(segment.start, segment.end) / SECONDS_PER_MONTH)
            out.append(charge(Resource.VOLUME, None, None, PriceClass.ON_DEMAND,
                               segment.price, gib_months, False))
    return out


LineKey = tuple[bool, str, str, str, str, Decimal]


def _lines(charges: list[Charge]) -> list[InvoiceLine]:
    grouped: dict[LineKey, list[Charge]] = defaultdict(list)
    for c in charges:
        grouped[(c.credited, c.resource.value, c.model or "", c.mig_profile or "",
                 c.price_class.value, c.unit_price)].append(c)
    lines = []
    for key in sorted(grouped):
        group = grouped[key]
        first = group[0]
        amount = round_money(sum((c.amount for c in group), Decimal(0)))
        lines.append(InvoiceLine(
            description=_describe(first), resource=first.resource, model=first.model,
            mig_profile=first.mig_profile, price_class=first.price_class,
            unit=UNITS[first.resource], unit_price=first.unit_price,
            quantity=round_money(sum((c.quantity for c in group), Decimal(0))),
            amount=-amount if first.credited else amount))
    return lines


def _describe(charge: Charge) -> str:
    what = {Resource.GPU: f"GPU {charge.model or 'unknown model'}"
            + (f" MIG {charge.mig_profile}" if charge.mig_profile else ""),
            Resource.CPU: "CPU cores (CPU-only pods)",
            Resource.VOLUME: "volume storage"}[charge.resource]
    text = f"{what}, {charge.price_class.value}"
    return f"credit: {text} (ended by a GPU fault)" if charge.credited else text
