"""Controller leases: one server replica at a time runs each background loop."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError

from gpucloud.db.models import ControllerLeaseModel
from gpucloud.db.session import rows_changed
from gpucloud.services.context import ServiceContext


def acquire(ctx: ServiceContext, name: str, holder: str, ttl_seconds: float) -> bool:
    """Take or renew the lease ``name`` for ``holder``; False while another holds it."""
    now = ctx.clock.now()
    expires = now + timedelta(seconds=ttl_seconds)
    with ctx.db.transaction() as session:
        taken = rows_changed(
            session,
            update(ControllerLeaseModel)
            .where(ControllerLeaseModel.name == name,
                   or_(ControllerLeaseModel.holder == holder,
                       ControllerLeaseModel.expires_at <= now))
            .values(holder=holder, expires_at=expires, token=ControllerLeaseModel.token + 1),
        )
        if taken:
            return True
        if session.scalar(select(ControllerLeaseModel.name).where(
                ControllerLeaseModel.name == name)):
            return False
    try:
        with ctx.db.transaction() as session:
            session.add(ControllerLeaseModel(name=name, holder=holder, expires_at=expires,
                                             token=1))
    except IntegrityError:
        return False
    return True
