"""Retention of raw usage samples: older than ``settings.usage_retention_days`` (default
7, ``GPUCLOUD_USAGE_RETENTION``) they are deleted; the meter (``pod_runs``) is kept, so
billed seconds and invoices never change.

Deleted in batches of ``batch`` rows, one short transaction each, node by node through
the ``(node_id, time)`` index, so a backlog of millions never holds one long transaction
or locks ingest out; at most ``max_batches`` per call, the rest on the next. The node
ids come from the samples themselves (a loose index scan over the primary key), so
samples of a node whose row was removed are pruned too.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, select, text, tuple_

from gpucloud.db.models import UsageSampleModel
from gpucloud.db.session import rows_changed
from gpucloud.services.context import ServiceContext

DEFAULT_BATCH = 5000
DEFAULT_MAX_BATCHES = 20
#: Each distinct node_id, one index probe apiece (PostgreSQL and SQLite alike).
_NODE_IDS = text(
    "WITH RECURSIVE n(id) AS (SELECT MIN(node_id) FROM usage_samples UNION ALL "
    "SELECT (SELECT MIN(node_id) FROM usage_samples WHERE node_id > n.id) FROM n "
    "WHERE n.id IS NOT NULL) SELECT id FROM n WHERE id IS NOT NULL")


def cutoff(ctx: ServiceContext, now: datetime) -> datetime:
    return now - timedelta(days=ctx.settings.usage_retention_days)


def prune(ctx: ServiceContext, batch: int = DEFAULT_BATCH,
          max_batches: int = DEFAULT_MAX_BATCHES) -> int:
    """Delete up to ``batch × max_batches`` samples older than the retention; how many."""
    before = cutoff(ctx, ctx.clock.now())
    with ctx.db.read() as session:
        node_ids = [str(n) for (n,) in session.execute(_NODE_IDS)]
    deleted, batches = 0, 0
    for node_id in node_ids:
        while batches < max_batches:
            batches += 1
            count = _delete_batch(ctx, node_id, before, batch)
            deleted += count
            if count < batch:
                break
        if batches >= max_batches:
            break
    return deleted


def _delete_batch(ctx: ServiceContext, node_id: str, before: datetime, batch: int) -> int:
    s = UsageSampleModel
    oldest = (select(s.node_id, s.pod_id, s.attempt, s.seq)
              .where(s.node_id == node_id, s.time < before).limit(batch))
    with ctx.db.transaction() as session:
        return rows_changed(session, delete(s).where(
            tuple_(s.node_id, s.pod_id, s.attempt, s.seq).in_(oldest)))
