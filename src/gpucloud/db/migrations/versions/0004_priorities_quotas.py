"""priority classes, pod and job priorities, preemption reservations, project quotas

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "priority_classes",
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("value", sa.Integer(), nullable=False),
        sa.Column("description", sa.String(length=200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "quotas",
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("gpus", sa.JSON(), nullable=False),
        sa.Column("borrow_limit", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("project_id"),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("priority", sa.Integer(), server_default="100",
                                      nullable=False))
        batch_op.add_column(sa.Column("nominated_until", sa.DateTime(timezone=True),
                                      nullable=True))

    with op.batch_alter_table("pods", schema=None) as batch_op:
        batch_op.add_column(sa.Column("priority_class", sa.String(length=63), nullable=True))
        batch_op.add_column(sa.Column("priority", sa.Integer(), server_default="100",
                                      nullable=False))
        batch_op.add_column(sa.Column("nominated_node_id", sa.String(length=32),
                                      nullable=True))
        batch_op.add_column(sa.Column("nominated_gpu_milli", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("nominated_until", sa.DateTime(timezone=True),
                                      nullable=True))
        batch_op.create_foreign_key("fk_pods_nominated_node_id_nodes", "nodes",
                                    ["nominated_node_id"], ["id"], ondelete="SET NULL")


def downgrade() -> None:
    with op.batch_alter_table("pods", schema=None) as batch_op:
        batch_op.drop_constraint("fk_pods_nominated_node_id_nodes", type_="foreignkey")
        batch_op.drop_column("nominated_until")
        batch_op.drop_column("nominated_gpu_milli")
        batch_op.drop_column("nominated_node_id")
        batch_op.drop_column("priority")
        batch_op.drop_column("priority_class")

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("nominated_until")
        batch_op.drop_column("priority")

    op.drop_table("quotas")
    op.drop_table("priority_classes")
