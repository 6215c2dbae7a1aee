"""usage_samples: node_id and pod_id compared bytewise (COLLATE "C") on PostgreSQL

Each sample inserted costs key comparisons in the primary key (node, pod, attempt, seq)
and in ``ix_usage_samples_node_time``; under a libc collation (``C.UTF-8``,
``en_US.UTF-8``) each text comparison goes through ``strcoll``, under "C" it is a
``memcmp``. Measured on the ingest statement (500-row batches, 2026-12-03,
docs/usage.md): the backend's CPU per row 19.0 → 15.3 µs on average, lower in 5 of 5
paired rounds. The ids are hex (services/context.new_id), so their order is the same in
every collation and no reader's result changes. SQLite compares bytewise already: a
no-op there. The ALTER rewrites the table and its indexes (an exclusive lock for as
long as that takes: on a large table, run it in a quiet window).

Revision ID: 0018
Revises: 0016 (0017 is reserved for the fleet's lease table; when it lands, this
revision follows it)
"""

from __future__ import annotations

from alembic import op

revision = "0018"
down_revision = "0016"
branch_labels = None
depends_on = None

_COLUMNS = ("node_id", "pod_id")


def upgrade() -> None:
    _retype('COLLATE "C"')


def downgrade() -> None:
    _retype("")  # the database's default collation again


def _retype(collate: str) -> None:
    """Both columns in one ALTER TABLE: the table and its indexes are rewritten once."""
    if op.get_bind().dialect.name != "postgresql":
        return
    changes = ", ".join(f"ALTER COLUMN {column} TYPE varchar(32) {collate}".rstrip()
                        for column in _COLUMNS)
    op.execute(f"ALTER TABLE usage_samples {changes}")
