"""jobs: gangs of member pods (pods.job_id, pods.rank, pods.ready_at)

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("phase", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.String(length=200), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("desired_state", sa.String(length=16), nullable=False),
        sa.Column("gang_state", sa.String(length=16), nullable=False),
        sa.Column("teardown", sa.String(length=16), nullable=True),
        sa.Column("image", sa.String(length=255), nullable=False),
        sa.Column("command", sa.JSON(), nullable=False),
        sa.Column("env", sa.JSON(), nullable=False),
        sa.Column("num_nodes", sa.Integer(), nullable=False),
        sa.Column("gpus_per_node", sa.Integer(), nullable=False),
        sa.Column("gpu_type", sa.String(length=64), nullable=True),
        sa.Column("cpu_milli", sa.BigInteger(), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("topology", sa.String(length=16), nullable=False),
        sa.Column("priority_class", sa.String(length=63), nullable=True),
        sa.Column("max_restarts", sa.Integer(), nullable=False),
        sa.Column("restarts", sa.Integer(), nullable=False),
        sa.Column("ready_timeout_seconds", sa.Float(), nullable=False),
        sa.Column("ready_timeouts", sa.Integer(), nullable=False),
        sa.Column("scheduled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("barrier_released_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("not_before", sa.DateTime(timezone=True), nullable=True),
        sa.Column("unschedulable", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lock_token", sa.String(length=32), nullable=True),
        sa.Column("lock_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index("ix_jobs_state_created", ["gang_state", "created_at"], unique=False)
        batch_op.create_index(
            "uq_jobs_project_name_live", ["project_id", "name"], unique=True,
            sqlite_where=sa.text("deleted_at IS NULL"),
            postgresql_where=sa.text("deleted_at IS NULL"),
        )

    with op.batch_alter_table("pods", schema=None) as batch_op:
        batch_op.add_column(sa.Column("job_id", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("rank", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("ready_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index(batch_op.f("ix_pods_job_id"), ["job_id"], unique=False)
        batch_op.create_foreign_key("fk_pods_job_id_jobs", "jobs", ["job_id"], ["id"],
                                    ondelete="CASCADE")


def downgrade() -> None:
    with op.batch_alter_table("pods", schema=None) as batch_op:
        batch_op.drop_constraint("fk_pods_job_id_jobs", type_="foreignkey")
        batch_op.drop_index(batch_op.f("ix_pods_job_id"))
        batch_op.drop_column("ready_at")
        batch_op.drop_column("rank")
        batch_op.drop_column("job_id")

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("uq_jobs_project_name_live")
        batch_op.drop_index("ix_jobs_state_created")

    op.drop_table("jobs")
