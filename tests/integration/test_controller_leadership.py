"""Controller leadership: one replica runs the loops, renewal at half-life, the epoch
(fencing token) moves on only with the holder, and a deposed leader's writes roll back."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from gpucloud.controllers.loops import LEADER_TTL_SECONDS, ControllerRunner
from gpucloud.core.clock import ManualClock
from gpucloud.db.models import ControllerLeaseModel, PriorityClassModel
from gpucloud.services import leadership
from gpucloud.services.context import ServiceContext


def _lease(ctx: ServiceContext) -> ControllerLeaseModel:
    with ctx.db.transaction() as session:
        return session.get_one(ControllerLeaseModel, "controllers")


def test_one_leader_at_a_time_and_takeover_after_expiry(ctx: ServiceContext,
                                                        clock: ManualClock) -> None:
    first, second = ControllerRunner(ctx), ControllerRunner(ctx)
    assert first._is_leader() and not second._is_leader()
    lease = _lease(ctx)
    assert lease.holder == first.holder and lease.token == 1
    clock.advance(LEADER_TTL_SECONDS / 4)
    assert first._is_leader()
    assert _lease(ctx).expires_at == lease.expires_at  # no write before half-life
    clock.advance(LEADER_TTL_SECONDS / 2)
    assert first._is_leader()
    renewed = _lease(ctx)
    assert renewed.expires_at > lease.expires_at and renewed.token == 1  # same epoch
    assert not second._is_leader()
    clock.advance(LEADER_TTL_SECONDS + 1)
    assert second._is_leader() and not first._is_leader()
    taken = _lease(ctx)
    assert taken.holder == second.holder and taken.token == 2  # a new epoch


def test_a_deposed_leaders_writes_are_refused(ctx: ServiceContext, clock: ManualClock) -> None:
    """The old leader still believes it leads (its renewal is not due) when another
    replica takes the lease over; its next write transaction is rolled back."""
    old = ControllerRunner(ctx)
    assert old._is_leader()
    with old.ctx.db.transaction() as session:  # the fence passes while it leads
        session.execute(update(PriorityClassModel).values(description="by epoch 1"))
    clock.advance(LEADER_TTL_SECONDS + 1)
    new = ControllerRunner(ctx)
    assert new._is_leader()
    with pytest.raises(leadership.LeaderLostError), old.ctx.db.transaction() as session:
        session.add(PriorityClassModel(name="late", value=1, created_at=clock.now()))
    with ctx.db.read() as session:
        assert session.get(PriorityClassModel, "late") is None
    assert old.leader.epoch is None  # it noticed


def test_release_hands_over_at_once(ctx: ServiceContext) -> None:
    first, second = ControllerRunner(ctx), ControllerRunner(ctx)
    assert first._is_leader()
    first.leader.stop()
    assert second._is_leader()
