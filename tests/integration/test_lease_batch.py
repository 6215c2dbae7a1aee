"""Renewals batched into one statement (services/lease_batch.py, api/lease_capacity.py),
each with the single renewal's guard and answer (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy import select

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
from tests.integration.conftest import statements_sent

UPDATES = frozenset({"UPDATE"})


def _register(ctx: ServiceContext, names: list[str]) -> list[NodeRegisterResponse]:
    projects.bootstrap_admin(ctx)
    admin = projects.authenticate(ctx, ADMIN_KEY)
    out = []
    for name in names:
        token = join_tokens.create(ctx, admin).token
        out.append(nodes.register_node(ctx, NodeRegisterRequest(
            join_token=token, name=name, cpu_cores=8, memory_bytes=2**34, gpus=[])))
    return out


def _expiry(ctx: ServiceContext, node_id: str) -> Any:
    with ctx.db.read() as session:
        return session.scalar(select(NodeModel.lease_expires_at).where(NodeModel.id == node_id))


def test_one_statement_renews_the_current_grants_and_leaves_the_rest_to_the_full_path(
    ctx: ServiceContext, clock: ManualClock,
) -> None:
    ok, stale, cordoned, lapsed = _register(ctx, ["ok", "stale", "cordoned", "lapsed"])
    with ctx.db.transaction() as session:
        session.get_one(NodeModel, cordoned.node_id).cordon_reason = "xid 79"
        session.get_one(NodeModel, lapsed.node_id).lease_expires_at = clock.now()
    clock.advance(1)
    before = {r.node_id: _expiry(ctx, r.node_id) for r in (ok, stale, cordoned, lapsed)}
    batch = [lease_batch.Renewal(ok.node_token, LeaseRequest(fencing_token=1)),
             lease_batch.Renewal(ok.node_token, LeaseRequest(fencing_token=1)),  # resent
             lease_batch.Renewal(stale.node_token, LeaseRequest(fencing_token=0)),
             lease_batch.Renewal("gpn_not-a-token", LeaseRequest(fencing_token=1)),
             lease_batch.Renewal(cordoned.node_token, LeaseRequest(fencing_token=1)),
             lease_batch.Renewal(cordoned.node_token,
                                 LeaseRequest(fencing_token=1, auto_uncordon=False)),
             lease_batch.Renewal(lapsed.node_token, LeaseRequest(fencing_token=1))]
    with statements_sent(ctx.db, UPDATES) as sent:
        results = lease_batch.renew_many(ctx, batch)
    assert len(sent) == 2  # one per auto_uncordon group, however many renewals
    renewed = [r is not None for r in results]
    assert renewed == [True, True, False, False, False, True, False]
    assert isinstance(results[0], LeaseResponse) and not results[0].new_grant
    assert _expiry(ctx, ok.node_id) > before[ok.node_id]
    assert _expiry(ctx, stale.node_id) == before[stale.node_id]
    assert _expiry(ctx, lapsed.node_id) == before[lapsed.node_id]
    assert _expiry(ctx, cordoned.node_id) > before[cordoned.node_id]  # auto_uncordon off


def test_renewals_arriving_together_share_one_statement(ctx: ServiceContext) -> None:
    registered = _register(ctx, [f"n{i}" for i in range(5)])

    async def renew_all() -> list[Any]:
        return await asyncio.gather(*(
            lease_capacity.renew_current(ctx, r.node_token, LeaseRequest(fencing_token=1))
            for r in registered))

    lease_ctx = lease_capacity.lease_context(ctx)  # the lease path's own pool (PostgreSQL)
    with statements_sent(lease_ctx.db, UPDATES) as sent:
        results = asyncio.run(renew_all())
    assert len(sent) == 1 and all(r is not None for r in results)
    with statements_sent(lease_ctx.db, UPDATES) as sent:  # one alone is one statement, at once
        alone = asyncio.run(lease_capacity.renew_current(
            ctx, registered[0].node_token, LeaseRequest(fencing_token=1)))
    assert len(sent) == 1 and alone is not None
