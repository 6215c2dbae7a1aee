"""Controller leadership: one replica runs the loops, renewal at half-life, the epoch
(fencing token) moves on only with the holder, and a deposed leader's writes roll back."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select, update

from gpucloud.controllers.loops import (
    LEADER_TTL_SECONDS,
    STANDBY_WARM_SECONDS,
    ControllerRunner,
)
from gpucloud.core.clock import ManualClock
from gpucloud.core.models import NodeRegisterRequest, PodCreateRequest
from gpucloud.db.models import ControllerLeaseModel, NodeModel, PriorityClassModel
from gpucloud.services import join_tokens, leadership, nodes, pods, projects, scheduling
from gpucloud.services.context import ServiceContext
from tests.conftest import ADMIN_KEY


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


def _register(ctx: ServiceContext, name: str) -> None:
    admin = projects.authenticate(ctx, ADMIN_KEY)
    nodes.register_node(ctx, NodeRegisterRequest(
        join_token=join_tokens.create(ctx, admin).token, name=name, cpu_cores=8,
        memory_bytes=2**34, gpus=[]))


def test_a_standby_keeps_the_scheduler_warm_for_its_takeover(
        ctx: ServiceContext, clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica that does not lead reads the cluster into its scheduler's cache every
    ``STANDBY_WARM_SECONDS``; when it takes over, its first pass loads only the node rows
    changed since (a cold leader loads every row), and places pods as a cold one would."""
    projects.bootstrap_admin(ctx)
    leader, standby = ControllerRunner(ctx), ControllerRunner(ctx)
    assert leader._is_leader() and not standby._is_leader()  # the first to ask leads
    for n in range(5):
        _register(ctx, f"node-{n}")
    assert not standby.run_once() and len(standby.scheduling.snapshots) == 5
    _register(ctx, "node-5")
    clock.advance(STANDBY_WARM_SECONDS - 1)
    standby.run_once()
    assert len(standby.scheduling.snapshots) == 5  # not due yet
    clock.advance(1)
    standby.run_once()
    assert len(standby.scheduling.snapshots) == 6
    assert leader.run_once() is False and leader._is_leader()

    loaded: list[str] = []
    load_nodes = scheduling._load_nodes

    def counted(session: Any, ids: list[str], everything: bool) -> Any:
        out = load_nodes(session, ids, everything)
        loaded.extend(out)
        return out

    monkeypatch.setattr(scheduling, "_load_nodes", counted)
    _register(ctx, "node-6")  # a change between its last warm-up and the takeover
    admin = projects.authenticate(ctx, ADMIN_KEY)
    pod = pods.create_pod(ctx, admin, PodCreateRequest(name="p", image="busybox", cpu=1))
    clock.advance(LEADER_TTL_SECONDS + 1)
    assert standby._is_leader() and not leader._is_leader()
    standby.run_once(woken=True)
    with ctx.db.read() as session:
        names = {n.id: n.name for n in session.scalars(select(NodeModel))}
    assert sorted(names[i] for i in loaded) == ["node-6"]
    assert pods.get_pod(ctx, admin, pod.id).node in names.values()
