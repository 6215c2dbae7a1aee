"""max duration of pods and jobs

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("pods", "jobs"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("max_duration_seconds", sa.Float(), nullable=True))


def downgrade() -> None:
    for table in ("jobs", "pods"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("max_duration_seconds")
