"""Priority classes: named priorities of pods and jobs; the defaults are always there."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpucloud.core.errors import InvalidInput
from gpucloud.core.policy import (
    DEFAULT_PRIORITY_CLASS,
    DEFAULT_PRIORITY_CLASSES,
    PriorityClassCreateRequest,
    PriorityClassOut,
)
from gpucloud.db.models import PriorityClassModel
from gpucloud.services.context import ServiceContext
from gpucloud.services.projects import Principal


def ensure_defaults(ctx: ServiceContext) -> None:
    """Write the default classes that are missing (at server start; idempotent)."""
    with ctx.db.transaction() as session:
        _add_missing_defaults(ctx, session)


def _add_missing_defaults(ctx: ServiceContext, session: Session) -> None:
    present = set(session.scalars(select(PriorityClassModel.name)))
    for name, (value, description) in DEFAULT_PRIORITY_CLASSES.items():
        if name not in present:
            session.add(PriorityClassModel(name=name, value=value, description=description,
                                           created_at=ctx.clock.now()))
    session.flush()


def _out(row: PriorityClassModel) -> PriorityClassOut:
    return PriorityClassOut(name=row.name, value=row.value, description=row.description,
                            created_at=row.created_at)


def list_classes(ctx: ServiceContext) -> list[PriorityClassOut]:
    with ctx.db.transaction() as session:
        _add_missing_defaults(ctx, session)
        rows = session.scalars(select(PriorityClassModel)
                               .order_by(PriorityClassModel.value, PriorityClassModel.name))
        return [_out(row) for row in rows]


def create_class(ctx: ServiceContext, caller: Principal,
                 request: PriorityClassCreateRequest) -> PriorityClassOut:
    caller.require_admin()
    if request.name in DEFAULT_PRIORITY_CLASSES:
        raise InvalidInput("name", f"{request.name!r} is a default priority class")
    row = PriorityClassModel(name=request.name, value=request.value,
                             description=request.description, created_at=ctx.clock.now())
    try:
        with ctx.db.transaction() as session:
            session.add(row)
            session.flush()
            created = _out(row)
    except IntegrityError:
        raise InvalidInput("name", f"priority class {request.name!r} already exists") from None
    ctx.cache.clear()
    return created


_CLASSES_KEY = "priority-classes"


def resolve_cached(ctx: ServiceContext, name: str | None) -> tuple[str, int]:
    """(name, value) of a class, the default class when ``name`` is None.

    Read through a short-lived cache of all classes: they change rarely, and this runs on
    every pod create. A class created on this replica is seen at once (the cache is
    cleared), one created on another replica within the cache's TTL."""
    classes = ctx.cache.get(_CLASSES_KEY)
    if not isinstance(classes, dict):
        with ctx.db.transaction() as session:
            rows = session.execute(select(PriorityClassModel.name, PriorityClassModel.value))
            classes = {name: value for name, value in rows}
        ctx.cache.put(_CLASSES_KEY, classes)
    name = name or DEFAULT_PRIORITY_CLASS
    value = classes.get(name, DEFAULT_PRIORITY_CLASSES.get(name, (None,))[0])
    if value is None:
        known = sorted({*DEFAULT_PRIORITY_CLASSES, *classes})
        raise InvalidInput("priority_class",
                           f"unknown priority class {name!r} (known: {', '.join(known)})")
    return name, int(value)

