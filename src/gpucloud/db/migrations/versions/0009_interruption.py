"""interruption statistics and checkpoint intervals: the checkpoint request signal and the
checkpoint mode of the container spec (pods, jobs, templates), node capabilities (CRIU)

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_SPEC_TABLES = ("pods", "jobs", "templates")


def upgrade() -> None:
    for table in _SPEC_TABLES:
        op.add_column(table, sa.Column("checkpoint_signal", sa.String(length=16),
                                       nullable=True))
        op.add_column(table, sa.Column("checkpoint_mode", sa.String(length=16), nullable=True))
    op.add_column("nodes", sa.Column("capabilities", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("capabilities")
    for table in _SPEC_TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("checkpoint_mode")
            batch.drop_column("checkpoint_signal")
