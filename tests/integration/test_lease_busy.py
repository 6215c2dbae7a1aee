"""A renewal never waits for a node row another transaction holds (a scheduling pass's
bind, a pod report): the batched statement skips the row and answers ``BUSY`` where the
renewal's guard held, and the renewal is sent again with a later statement instead of
taking the full path, whose row lock would wait (services/lease_batch.py,
api/lease_capacity.py). PostgreSQL only: SQLite has one writer and no row locks."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi import HTTPException
from sqlalchemy import Connection, select, update

from gpucloud.api import lease_capacity
from gpucloud.core.clock import ManualClock
from gpucloud.core.models import (
    LeaseRequest,
    LeaseResponse,
    NodeRegisterRequest,
    NodeRegisterResponse,
)
from gpucloud.db.models import NodeModel
from gpucloud.services import join_tokens, lease_batch, nodes, projects
from gpucloud.services.context import ServiceContext
from tests.conftest import ADMIN_KEY


@pytest.fixture
def pg(ctx: ServiceContext) -> ServiceContext:
    if ctx.db.is_sqlite:
        pytest.skip("row locks: PostgreSQL")
    return ctx


def _register(ctx: ServiceContext, names: list[str]) -> list[NodeRegisterResponse]:
    projects.bootstrap_admin(ctx)
    admin = projects.authenticate(ctx, ADMIN_KEY)
    return [nodes.register_node(ctx, NodeRegisterRequest(
        join_token=join_tokens.create(ctx, admin).token, name=name, cpu_cores=8,
        memory_bytes=2**34, gpus=[])) for name in names]


def _expiry(ctx: ServiceContext, node_id: str) -> Any:
    with ctx.db.read() as session:
        return session.scalar(select(NodeModel.lease_expires_at).where(NodeModel.id == node_id))


@contextmanager
def _held(ctx: ServiceContext, node_id: str) -> Iterator[Connection]:
    """The node's row locked by an open transaction (as a bind's claim holds it), the
    version bumped as a bind does, until the block ends (then committed)."""
    with ctx.db.engine.connect() as holder, holder.begin():
        holder.execute(update(NodeModel).where(NodeModel.id == node_id)
                       .values(version=NodeModel.version + 1))
        yield holder


def _in_thread(function: Any, *args: Any) -> Any:
    """``function(*args)`` on a thread, its result; fails if it blocked (a row lock)."""
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(result=function(*args)), daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the renewal waited for the held row"
    return out["result"]


def test_a_held_row_is_busy_not_waited_for_and_the_others_are_renewed(
    pg: ServiceContext, clock: ManualClock,
) -> None:
    free, held, stale = _register(pg, ["free", "held", "stale"])
    clock.advance(1)
    before = {r.node_id: _expiry(pg, r.node_id) for r in (free, held, stale)}
    batch = [lease_batch.Renewal(free.node_token, LeaseRequest(fencing_token=1)),
             lease_batch.Renewal(held.node_token, LeaseRequest(fencing_token=1)),
             lease_batch.Renewal(held.node_token, LeaseRequest(fencing_token=1)),  # resent
             lease_batch.Renewal(stale.node_token, LeaseRequest(fencing_token=0))]
    with _held(pg, held.node_id), _held(pg, stale.node_id):
        results = _in_thread(lease_batch.renew_many, pg, batch)
        # the held row's guard holds: BUSY (send again); the stale token's does not:
        # the full path answers it (409), held row or not
        assert results[1] is lease_batch.BUSY and results[2] is lease_batch.BUSY
        assert results[3] is None
        assert isinstance(results[0], LeaseResponse) and not results[0].new_grant
    assert _expiry(pg, free.node_id) > before[free.node_id]
    assert _expiry(pg, held.node_id) == before[held.node_id]  # not renewed behind the lock
    assert _expiry(pg, stale.node_id) == before[stale.node_id]


def test_a_busy_renewal_is_sent_again_and_renewed_once_the_holder_commits(
    pg: ServiceContext, clock: ManualClock, monkeypatch: pytest.MonkeyPatch,
) -> None:
    (reg,) = _register(pg, ["n1"])
    clock.advance(1)
    before = _expiry(pg, reg.node_id)
    lease_ctx = lease_capacity.lease_context(pg)
    tries: list[int] = []
    renew_many = lease_batch.renew_many

    def counted(ctx: ServiceContext, renewals: list[lease_batch.Renewal]) -> Any:
        tries.append(len(renewals))
        return renew_many(ctx, renewals)

    async def scenario() -> Any:
        with _held(pg, reg.node_id):
            task = asyncio.create_task(lease_capacity.renew_current(
                pg, reg.node_token, LeaseRequest(fencing_token=1), clock.now()))
            while len(tries) < 2:  # sent, busy, sent again: waiting on no lock
                await asyncio.sleep(0.01)
            assert not task.done()
        return await task  # the holder committed: the next statement renews it

    monkeypatch.setattr(lease_batch, "renew_many", counted)
    response = asyncio.run(scenario())
    assert response is not None and not response.new_grant and response.fencing_token == 1
    assert _expiry(pg, reg.node_id) > before
    assert lease_ctx.db is not pg.db  # the lease path's own pool did it


def test_a_renewal_held_past_half_the_ttl_is_refused_never_applied_late(
    pg: ServiceContext, clock: ManualClock,
) -> None:
    (reg,) = _register(pg, ["n1"])
    before = _expiry(pg, reg.node_id)

    async def scenario() -> None:
        with _held(pg, reg.node_id):
            task = asyncio.create_task(lease_capacity.renew_current(
                pg, reg.node_token, LeaseRequest(fencing_token=1), clock.now()))
            await asyncio.sleep(0.1)  # busy, sent again meanwhile
            clock.advance(pg.settings.lease_ttl_seconds * 0.6)
            with pytest.raises(HTTPException) as refused:
                await task
            assert refused.value.status_code == 503

    asyncio.run(scenario())
    assert _expiry(pg, reg.node_id) == before


def test_a_row_held_past_the_busy_limit_goes_to_the_full_path(
    pg: ServiceContext, clock: ManualClock, monkeypatch: pytest.MonkeyPatch,
) -> None:
    (reg,) = _register(pg, ["n1"])
    monkeypatch.setattr(lease_capacity, "BUSY_LIMIT_S", 0.05)

    async def scenario() -> Any:
        with _held(pg, reg.node_id):
            return await lease_capacity.renew_current(
                pg, reg.node_token, LeaseRequest(fencing_token=1), clock.now())

    assert asyncio.run(scenario()) is None  # the caller's full path answers it
