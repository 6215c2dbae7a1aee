"""Controller leadership: one replica runs the loops; renewal only at half-life."""

from __future__ import annotations

from gpucloud.controllers.loops import LEADER_TTL_SECONDS, ControllerRunner
from gpucloud.core.clock import ManualClock
from gpucloud.db.models import ControllerLeaseModel
from gpucloud.services.context import ServiceContext


def test_one_leader_at_a_time_and_takeover_after_expiry(ctx: ServiceContext,
                                                        clock: ManualClock) -> None:
    db = ctx.db
    first, second = ControllerRunner(ctx), ControllerRunner(ctx)
    assert first._is_leader() and not second._is_leader()
    with db.transaction() as session:
        token = session.get_one(ControllerLeaseModel, "controllers").token
    clock.advance(LEADER_TTL_SECONDS / 4)
    assert first._is_leader()
    with db.transaction() as session:
        assert session.get_one(ControllerLeaseModel, "controllers").token == token
    clock.advance(LEADER_TTL_SECONDS / 2)
    assert first._is_leader()
    with db.transaction() as session:
        assert session.get_one(ControllerLeaseModel, "controllers").token == token + 1
    clock.advance(LEADER_TTL_SECONDS + 1)
    assert second._is_leader() and not first._is_leader()
