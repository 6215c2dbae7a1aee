"""The price catalog: versioned prices an admin sets, over the built-in defaults.

A price is keyed by (resource, GPU model, MIG profile, class) and has versions, each in
effect from its ``effective_at`` until the next one, so usage is always priced at what was
in effect while it ran (a run across a price change is split at that time). Where no
version is in effect the built-in RunPod-like default applies (``core.price_defaults``);
a MIG instance without a price of its own costs its compute slices' share of the GPU
(``3g.40gb``: 3/7 of the GPU price in effect).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.core import price_defaults
from gpucloud.core.billing import (
    MIG_SLICES,
    UNITS,
    PriceClass,
    PriceOut,
    PriceSetRequest,
    Resource,
    from_micros,
    mig_slices,
    to_micros,
)
from gpucloud.core.errors import InvalidInput
from gpucloud.core.gpu_models import CATALOG, canonical_name, is_well_formed, lookup
from gpucloud.db.models import NodeModel, PriceModel
from gpucloud.services.context import ServiceContext
from gpucloud.services.projects import Principal

#: (resource, GPU model or '', MIG profile or '', class)
PriceKey = tuple[str, str, str, str]
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Segment:
    """A stretch of time at one price per unit-hour (per GiB-month for volumes)."""

    start: datetime
    end: datetime
    price: Decimal


Fallback = Callable[[datetime, datetime], list[Segment]]


@dataclass
class PriceBook:
    """Every set price version, loaded once per computation (the table is small)."""

    versions: dict[PriceKey, list[tuple[datetime, Decimal]]] = field(default_factory=dict)

    def gpu(self, model: str, profile: str | None, price_class: PriceClass, start: datetime,
            end: datetime) -> list[Segment]:
        """Per GPU-hour of ``model`` (per instance-hour of a MIG ``profile``)."""
        base = self._filled((Resource.GPU.value, model, "", price_class.value), start, end,
                            lambda s, e: [Segment(s, e, default_gpu(model, price_class))])
        if not profile:
            return base
        share = Decimal(mig_slices(profile)) / MIG_SLICES

        def derived(s: datetime, e: datetime) -> list[Segment]:
            return [Segment(max(g.start, s), min(g.end, e), g.price * share) for g in base
                    if g.start < e and g.end > s]

        return self._filled((Resource.GPU.value, model, profile, price_class.value), start,
                            end, derived)

    def flat(self, resource: Resource, price_class: PriceClass, start: datetime,
             end: datetime) -> list[Segment]:
        """Per core-hour (cpu) or GiB-month (volume)."""
        default = default_flat(resource)
        return self._filled((resource.value, "", "", price_class.value), start, end,
                            lambda s, e: [Segment(s, e, default)])

    def _filled(self, key: PriceKey, start: datetime, end: datetime,
                fallback: Fallback) -> list[Segment]:
        """The set versions of ``key`` over [start, end), ``fallback`` where none is in
        effect (before the first version)."""
        versions = self.versions.get(key, [])
        out: list[Segment] = []
        first = versions[0][0] if versions else end
        if start < first:
            out.extend(fallback(start, min(first, end)))
        for index, (effective, price) in enumerate(versions):
            until = versions[index + 1][0] if index + 1 < len(versions) else end
            s, e = max(start, effective), min(end, until)
            if s < e:
                out.append(Segment(s, e, price))
        return out


def default_gpu(model: str, price_class: PriceClass) -> Decimal:
    """The built-in price of a GPU model; 0 for a model the list does not know."""
    prices = price_defaults.GPU_PER_HOUR.get(model)
    if prices is None:
        return Decimal(0)
    return prices[0] if price_class is PriceClass.ON_DEMAND else prices[1]


def default_flat(resource: Resource) -> Decimal:
    if resource is Resource.CPU:
        return price_defaults.CPU_PER_CORE_HOUR
    return price_defaults.VOLUME_PER_GIB_MONTH


def load_book(session: Session) -> PriceBook:
    versions: dict[PriceKey, list[tuple[datetime, Decimal]]] = defaultdict(list)
    rows = session.scalars(select(PriceModel).order_by(PriceModel.effective_at))
    for row in rows:
        key = (row.resource, row.gpu_model, row.mig_profile, row.price_class)
        versions[key].append((row.effective_at, from_micros(row.micros)))
    return PriceBook(dict(versions))


def known_models(session: Session) -> set[str]:
    """The catalog's models and every model a registered node has (canonical names)."""
    models = {m.name for m in CATALOG}
    for gpus in session.scalars(select(NodeModel.gpus)):
        models.update(canonical_name(str(gpu.get("model", ""))) for gpu in gpus)
    return models


def _checked_key(session: Session, request: PriceSetRequest) -> PriceKey:
    """The row key of a price to set; 422 naming the field for what does not fit."""
    if request.resource is not Resource.GPU:
        if request.model or request.mig_profile:
            raise InvalidInput("model", f"a {request.resource.value} price has no GPU model")
        return request.resource.value, "", "", request.price_class.value
    if not request.model or not is_well_formed(request.model):
        raise InvalidInput("model", "a GPU price needs a GPU model, e.g. H100-80GB")
    model = canonical_name(request.model)
    if model not in known_models(session):
        raise InvalidInput("model", f"unknown GPU model {request.model!r}; known: "
                           + ", ".join(m.name for m in CATALOG))
    catalog = lookup(model)
    if request.mig_profile and catalog is not None and not catalog.mig_capable:
        raise InvalidInput("mig_profile", f"{model} has no MIG profiles")
    return Resource.GPU.value, model, request.mig_profile or "", request.price_class.value


def set_price(ctx: ServiceContext, caller: Principal, request: PriceSetRequest) -> PriceOut:
    """Add a version of a price (admin); the same key and effective time is replaced."""
    caller.require_admin()
    now = ctx.clock.now()
    effective = request.effective_at or now
    with ctx.db.transaction() as session:
        key = _checked_key(session, request)
        row = session.scalar(select(PriceModel).where(
            PriceModel.resource == key[0], PriceModel.gpu_model == key[1],
            PriceModel.mig_profile == key[2], PriceModel.price_class == key[3],
            PriceModel.effective_at == effective))
        if row is None:
            row = PriceModel(resource=key[0], gpu_model=key[1], mig_profile=key[2],
                             price_class=key[3], effective_at=effective, created_at=now)
            session.add(row)
        row.micros = to_micros(request.price)
        session.flush()
        return _out(key, from_micros(row.micros), effective, "set")


def _out(key: PriceKey, price: Decimal, effective: datetime | None, source: str) -> PriceOut:
    resource = Resource(key[0])
    return PriceOut(resource=resource, model=key[1] or None, mig_profile=key[2] or None,
                    price_class=PriceClass(key[3]), price=price, unit=UNITS[resource],
                    effective_at=effective, source=source)


def _default_keys() -> dict[PriceKey, Decimal]:
    keys: dict[PriceKey, Decimal] = {}
    for price_class in PriceClass:
        for model in price_defaults.GPU_PER_HOUR:
            keys[(Resource.GPU.value, model, "", price_class.value)] = default_gpu(
                model, price_class)
        for resource in (Resource.CPU, Resource.VOLUME):
            keys[(resource.value, "", "", price_class.value)] = default_flat(resource)
    return keys


def list_prices(ctx: ServiceContext) -> list[PriceOut]:
    """Every set version (past, current, future), and the default of each key that has
    no set version in effect now."""
    now = ctx.clock.now()
    with ctx.db.read() as session:
        book = load_book(session)
    out: list[PriceOut] = []
    for key, price in _default_keys().items():
        if not any(effective <= now for effective, _ in book.versions.get(key, [])):
            out.append(_out(key, price, None, "default"))
    for key, versions in book.versions.items():
        out.extend(_out(key, price, effective, "set") for effective, price in versions)
    return sorted(out, key=lambda p: (p.resource.value, p.model or "", p.mig_profile or "",
                                      p.price_class.value, p.effective_at or EPOCH))
