"""Wire types and exact money arithmetic of prices, usage, invoices and spend limits.

Money is ``Decimal`` on the wire (a JSON string, never a float) and integer micro-units
(millionths of the currency unit, ``MICRO``) in the database; amounts are rounded to the
micro-unit once per invoice line, so a total is always the exact sum of its lines.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, Field, field_validator

from gpucloud.core.spec import _Request

MICRO = Decimal("0.000001")
MICROS_PER_UNIT = 1_000_000
#: Prices are at most this per unit (a sanity bound, not a business rule).
MAX_PRICE = Decimal("1000000")
SECONDS_PER_HOUR = 3600
#: A "month" of per-GiB-month volume prices: 30 days (RunPod and most clouds bill storage
#: by the hour at monthly price / 720 h).
SECONDS_PER_MONTH = 30 * 24 * 3600
GIB = 1024**3
#: Compute slices of a full GPU for MIG profiles (``3g.40gb`` is 3 of 7).
MIG_SLICES = 7
_MONTH = re.compile(r"^(\d{4})-(\d{2})$")
_MIG_PROFILE = re.compile(r"^([1-7])g\.(\d{1,3})gb$")


class PriceClass(StrEnum):
    ON_DEMAND = "on-demand"
    SPOT = "spot"


class Resource(StrEnum):
    """What a price is for: a GPU (whole, share or MIG instance) per hour, a CPU core of a
    CPU-only pod per hour, a GiB of volume per month."""

    GPU = "gpu"
    CPU = "cpu"
    VOLUME = "volume"


UNITS = {Resource.GPU: "gpu-hour", Resource.CPU: "core-hour", Resource.VOLUME: "gib-month"}


def parse_money(value: Any) -> Decimal:
    """A non-negative decimal amount from a string or number; floats go through their
    shortest repr (``3.6`` is ``3.6``, not ``3.59999…``)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float | Decimal):
        raise ValueError("must be a decimal number such as 3.60")
    try:
        amount = Decimal(str(value).strip())
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a decimal number") from None
    if not amount.is_finite():
        raise ValueError(f"{value!r} is not a finite number")
    if amount < 0:
        raise ValueError(f"{value} is negative")
    if amount > MAX_PRICE:
        raise ValueError(f"{value} is more than {MAX_PRICE}")
    if amount != amount.quantize(MICRO):
        raise ValueError(f"{value} has more than 6 decimal places")
    return amount


def to_micros(amount: Decimal) -> int:
    return int(amount * MICROS_PER_UNIT)


def from_micros(micros: int) -> Decimal:
    return (Decimal(micros) / MICROS_PER_UNIT).quantize(MICRO)


def round_money(amount: Decimal) -> Decimal:
    return amount.quantize(MICRO, rounding=ROUND_HALF_EVEN)


def parse_month(value: str) -> tuple[datetime, datetime]:
    """``YYYY-MM`` → the month's [start, end) in UTC."""
    match = _MONTH.match(value.strip())
    if not match or not 1 <= int(match.group(2)) <= 12:
        raise ValueError(f"{value!r} is not a month; use YYYY-MM, e.g. 2026-12")
    year, month = int(match.group(1)), int(match.group(2))
    if year < 1970:
        raise ValueError(f"{value!r} is before 1970")
    start = datetime(year, month, 1, tzinfo=UTC)
    end = datetime(year + month // 12, month % 12 + 1, 1, tzinfo=UTC)
    return start, end


def as_utc(value: datetime) -> datetime:
    """A time in UTC (UTC when it has no zone); ValueError when UTC cannot hold it."""
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"{value.isoformat()} is out of range") from None


def mig_slices(profile: str) -> int:
    """Compute slices of a MIG profile name (``1g.10gb`` → 1)."""
    match = _MIG_PROFILE.match(profile.strip().lower())
    if not match:
        raise ValueError(f"{profile!r} is not a MIG profile such as 1g.10gb or 3g.40gb")
    return int(match.group(1))


Money = Annotated[Decimal, BeforeValidator(parse_money)]


class PriceSetRequest(_Request):
    """``gpucloud price set MODEL --class on-demand|spot --per-gpu-hour 3.60``.

    ``resource`` gpu (``model`` a GPU model, optional ``mig_profile``), cpu (per core-hour
    of CPU-only pods) or volume (per GiB-month); ``effective_at``: from when (default now;
    earlier usage keeps the price that was in effect then)."""

    resource: Resource = Resource.GPU
    model: str | None = Field(default=None, max_length=64)
    mig_profile: str | None = Field(default=None, max_length=16)
    price_class: PriceClass = PriceClass.ON_DEMAND
    price: Money
    effective_at: datetime | None = None

    @field_validator("mig_profile")
    @classmethod
    def _mig(cls, value: str | None) -> str | None:
        if value is None:
            return None
        mig_slices(value)
        return value.strip().lower()

    @field_validator("effective_at")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        return None if value is None else as_utc(value)


class PriceOut(BaseModel):
    resource: Resource
    model: str | None = None
    mig_profile: str | None = None
    price_class: PriceClass
    price: Decimal
    unit: str
    effective_at: datetime | None = None
    #: ``set`` (an admin's price) or ``default`` (the built-in RunPod-like list).
    source: str


class UsageBy(StrEnum):
    POD = "pod"
    JOB = "job"
    GPU_TYPE = "gpu-type"
    DAY = "day"


#: Which usage figures come from the meter's start/stop times and the allocation
#: (billed), and which from samples (measured, for efficiency only).
ALLOCATED_FIELDS = ("seconds", "gpu_seconds", "cpu_core_seconds", "cost", "credited")
MEASURED_FIELDS = ("gpu_util_avg", "cpu_seconds")


class UsageRow(BaseModel):
    """One group of usage. ``gpu_seconds`` is allocated GPUs (whole, share or MIG slices
    of 7) × billed seconds; ``gpu_util_avg`` is the measured device utilisation in percent
    (None where it cannot be measured: MIG, or no samples)."""

    key: str
    pod: str | None = None
    pod_id: str | None = None
    job_id: str | None = None
    gpu_type: str | None = None
    day: str | None = None
    runs: int
    seconds: float
    gpu_seconds: float
    cpu_core_seconds: float
    gpu_util_avg: float | None = None
    cpu_seconds: float | None = None
    cost: Decimal
    credited: Decimal
    allocated: list[str] = Field(default_factory=lambda: list(ALLOCATED_FIELDS))
    measured: list[str] = Field(default_factory=lambda: list(MEASURED_FIELDS))


class UsageOut(BaseModel):
    project: str
    since: datetime
    until: datetime
    by: UsageBy
    rows: list[UsageRow]
    total_cost: Decimal


class InvoiceLine(BaseModel):
    """One resource at one price: ``quantity`` units (GPU-hours, core-hours, GiB-months)
    × ``unit_price`` = ``amount`` (rounded to the micro-unit); credits are negative."""

    description: str
    resource: Resource
    model: str | None = None
    mig_profile: str | None = None
    price_class: PriceClass
    unit: str
    quantity: Decimal
    unit_price: Decimal
    amount: Decimal


class InvoiceOut(BaseModel):
    project: str
    month: str
    period_start: datetime
    period_end: datetime
    lines: list[InvoiceLine]
    charges: Decimal
    credits: Decimal
    total: Decimal
    currency: str = "USD"


class SpendLimitSetRequest(_Request):
    """``per_hour``: the most the project's admitted pods may cost per hour (None: no
    limit); ``credit``: a prepaid balance from now on (None: postpaid, no balance)."""

    per_hour: Money | None = None
    credit: Money | None = None


class SpendLimitOut(BaseModel):
    project: str
    per_hour: Decimal | None = None
    reserved_per_hour: Decimal
    credit: Decimal | None = None
    credit_since: datetime | None = None
    spent_since_credit: Decimal | None = None
    balance: Decimal | None = None
    updated_at: datetime | None = None
