"""spot pods and jobs, preemption records, node drain

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_TZ = sa.DateTime(timezone=True)
_SPEC_TABLES = ("pods", "jobs", "templates")


def _spec_columns() -> list[sa.Column[object]]:
    """``--spot``, ``--bid`` and ``--grace``: part of the one container spec."""
    return [
        sa.Column("spot", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("bid", sa.Float(), nullable=True),
        sa.Column("grace_seconds", sa.Float(), nullable=True),
    ]


def _preemption_columns() -> list[sa.Column[object]]:
    """The preemption record of pods and jobs."""
    return [
        sa.Column("preemptions", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("last_preemption_reason", sa.String(length=16), nullable=True),
        sa.Column("last_preempted_at", _TZ, nullable=True),
        sa.Column("time_lost_seconds", sa.Float(), nullable=False, server_default="0"),
    ]


def _drain_columns() -> list[sa.Column[object]]:
    return [
        sa.Column("drain_state", sa.String(length=16), nullable=True),
        sa.Column("drain_requested_at", _TZ, nullable=True),
        sa.Column("drain_started_at", _TZ, nullable=True),
        sa.Column("drain_deadline_seconds", sa.Float(), nullable=True),
        sa.Column("drain_finished_at", _TZ, nullable=True),
        sa.Column("drain_pods_total", sa.Integer(), nullable=False, server_default="0"),
    ]


def upgrade() -> None:
    for table in _SPEC_TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            for column in _spec_columns():
                batch_op.add_column(column)
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        for column in _preemption_columns():
            batch_op.add_column(column)
    with op.batch_alter_table("pods", schema=None) as batch_op:
        for column in _preemption_columns():
            batch_op.add_column(column)
        batch_op.add_column(sa.Column("stop_notice", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("avoid_node_id", sa.String(length=32), nullable=True))
        batch_op.create_foreign_key("fk_pods_avoid_node_id_nodes", "nodes",
                                    ["avoid_node_id"], ["id"], ondelete="SET NULL")
        batch_op.add_column(sa.Column("avoid_until", _TZ, nullable=True))
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        for column in _drain_columns():
            batch_op.add_column(column)


def downgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        for column in _drain_columns():
            batch_op.drop_column(column.name)
    with op.batch_alter_table("pods", schema=None) as batch_op:
        batch_op.drop_constraint("fk_pods_avoid_node_id_nodes", type_="foreignkey")
        for name in ("avoid_until", "avoid_node_id", "stop_notice"):
            batch_op.drop_column(name)
        for column in _preemption_columns():
            batch_op.drop_column(column.name)
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        for column in _preemption_columns():
            batch_op.drop_column(column.name)
    for table in _SPEC_TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            for column in _spec_columns():
                batch_op.drop_column(column.name)
