"""Pricing of metered runs: a run clipped to a period, cut where a price changes and at
UTC midnight, each piece priced (see ``services.billing`` for the rules).

Kept apart from ``services.billing`` (which reads the meter through
``services.usage.pod_runs``) so that pod admission (``services.admission``, imported by
``services.pods``) can price runs without importing ``services.usage``, whose import of
``services.nodes`` imports ``services.pods`` again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Generic, Protocol, TypeVar

from gpucloud.core.billing import (
    GIB,
    SECONDS_PER_HOUR,
    SECONDS_PER_MONTH,
    PriceClass,
    Resource,
    round_money,
)
from gpucloud.core.gpu_models import canonical_name
from gpucloud.services.prices import PriceBook, Segment

_ONE_DAY = timedelta(days=1)


class PricedRun(Protocol):
    """What pricing reads of a meter row (``core.usage.PodRun`` or ``PodRunModel``)."""

    @property
    def pod_id(self) -> str: ...
    @property
    def job_id(self) -> str | None: ...
    @property
    def gpu_type(self) -> str | None: ...
    @property
    def gpus(self) -> float: ...
    @property
    def gpu_milli(self) -> int: ...
    @property
    def mig_profile(self) -> str | None: ...
    @property
    def cpu_milli(self) -> int: ...
    @property
    def volume_bytes(self) -> int | None: ...
    @property
    def spot(self) -> bool: ...
    @property
    def started_at(self) -> datetime: ...
    @property
    def ended_at(self) -> datetime | None: ...
    @property
    def credited(self) -> bool: ...


def seconds_between(start: datetime, end: datetime) -> Decimal:
    """Exact seconds (microsecond resolution) from ``start`` to ``end``."""
    return Decimal((end - start) // timedelta(microseconds=1)) / 1_000_000


def gpu_quantity(run: PricedRun) -> Decimal:
    """GPUs allocated: MIG instances, else the milli-GPU allocation / 1000, else gpus."""
    if run.mig_profile:
        return Decimal(max(1, int(run.gpus or 1)))
    if run.gpu_milli:
        return Decimal(run.gpu_milli) / 1000
    return Decimal(str(run.gpus or 0))


def price_class(run: PricedRun) -> PriceClass:
    return PriceClass.SPOT if run.spot else PriceClass.ON_DEMAND


@dataclass(frozen=True)
class Charge:
    """One priced part of a piece of a run (an invoice line's ingredient)."""

    resource: Resource
    model: str | None
    mig_profile: str | None
    price_class: PriceClass
    unit_price: Decimal
    quantity: Decimal  # in the price's unit: GPU-hours, core-hours, GiB-months
    amount: Decimal    # exact
    credited: bool


R = TypeVar("R", bound=PricedRun)


@dataclass
class Piece(Generic[R]):
    """A run clipped to one price segment and one UTC day."""

    run: R
    start: datetime
    end: datetime
    seconds: Decimal
    gpu_seconds: Decimal
    run_seconds: Decimal
    charges: list[Charge] = field(default_factory=list)

    @property
    def cost(self) -> Decimal:
        return sum((c.amount for c in self.charges if not c.credited), Decimal(0))

    @property
    def credited(self) -> Decimal:
        return sum((c.amount for c in self.charges if c.credited), Decimal(0))


def _days(start: datetime, end: datetime) -> Iterator[tuple[datetime, datetime]]:
    cursor = start
    while cursor < end:
        midnight = cursor.replace(hour=0, minute=0, second=0, microsecond=0) + _ONE_DAY
        yield cursor, min(midnight, end)
        cursor = midnight


def _bounds(segments: Iterable[list[Segment]]) -> list[datetime]:
    return sorted({t for group in segments for s in group for t in (s.start, s.end)})


def _price_at(segments: list[Segment], start: datetime) -> Decimal:
    for segment in segments:
        if segment.start <= start < segment.end:
            return segment.price
    return Decimal(0)


def pieces(book: PriceBook, runs: Iterable[R], since: datetime,
           until: datetime) -> list[Piece[R]]:
    """Every run clipped to [since, until) and cut at price changes and midnights."""
    out: list[Piece[R]] = []
    for run in runs:
        start, end = max(run.started_at, since), min(run.ended_at or until, until)
        if start >= end:
            continue
        run_seconds = seconds_between(run.started_at, run.ended_at or until)
        for day_start, day_end in _days(start, end):
            out.extend(_priced(book, run, day_start, day_end, run_seconds))
    return out


def _priced(book: PriceBook, run: R, start: datetime, end: datetime,
            run_seconds: Decimal) -> list[Piece[R]]:
    cls = price_class(run)
    model = canonical_name(run.gpu_type) if run.gpu_type else None
    gpus = gpu_quantity(run)
    gpu = book.gpu(model or "", run.mig_profile, cls, start, end) if gpus else []
    cpu = [] if gpus else book.flat(Resource.CPU, cls, start, end)
    volume = book.flat(Resource.VOLUME, cls, start, end) if run.volume_bytes else []
    bounds = _bounds([gpu, cpu, volume, [Segment(start, end, Decimal(0))]])
    credited = run.credited
    out: list[Piece[R]] = []
    for s, e in zip(bounds, bounds[1:], strict=False):
        seconds = seconds_between(s, e)
        piece = Piece(run, s, e, seconds, gpus * seconds, run_seconds)
        hours = seconds / SECONDS_PER_HOUR
        if gpus:
            piece.charges.append(charge(Resource.GPU, model, run.mig_profile, cls,
                                         _price_at(gpu, s), gpus * hours, credited))
        else:
            cores = Decimal(run.cpu_milli) / 1000
            piece.charges.append(charge(Resource.CPU, None, None, cls, _price_at(cpu, s),
                                         cores * hours, credited))
        if run.volume_bytes:
            gib_months = Decimal(run.volume_bytes) / GIB * seconds / SECONDS_PER_MONTH
            piece.charges.append(charge(Resource.VOLUME, None, None, cls,
                                         _price_at(volume, s), gib_months, credited))
        out.append(piece)
    return out


def charge(resource: Resource, model: str | None, mig: str | None, cls: PriceClass,
            price: Decimal, quantity: Decimal, credited: bool) -> Charge:
    return Charge(resource, model, mig, cls, price, quantity, price * quantity, credited)


def cost_of(book: PriceBook, runs: Iterable[PricedRun], since: datetime,
            until: datetime) -> Decimal:
    """The net cost (credits taken off) of ``runs`` over [since, until), rounded once."""
    return round_money(sum((p.cost for p in pieces(book, runs, since, until)), Decimal(0)))
