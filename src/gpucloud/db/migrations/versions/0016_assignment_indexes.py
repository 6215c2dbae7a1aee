"""pods: indexes for a node's assignments (its volume disks and their migrations)

Every bind builds the node's answer, which reads the live pods whose volume disk is pinned
to the node or being copied from it (``services.migration.node_volumes``); without these
the read scans every pod row. Both columns are NULL for most pods: partial indexes.

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

_INDEXES = {"ix_pods_volume_node": "volume_node_id",
            "ix_pods_volume_source_node": "volume_source_node_id"}


def upgrade() -> None:
    for name, column in _INDEXES.items():
        where = sa.text(f"{column} IS NOT NULL")
        op.create_index(name, "pods", [column], sqlite_where=where, postgresql_where=where)


def downgrade() -> None:
    for name in _INDEXES:
        op.drop_index(name, table_name="pods")
