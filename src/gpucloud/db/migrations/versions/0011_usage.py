"""usage samples and the meter: usage_samples, pod_runs, nodes.lease_renewed_at

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("lease_renewed_at", _TZ, nullable=True))
    op.create_table(
        "usage_samples",
        sa.Column("node_id", sa.String(length=32), nullable=False),
        sa.Column("pod_id", sa.String(length=32), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("time", _TZ, nullable=False),
        sa.Column("cpu_seconds", sa.Float(), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("memory_peak_bytes", sa.BigInteger(), nullable=False),
        sa.Column("gpu_util_percent", sa.Float(), nullable=True),
        sa.Column("gpu_memory_bytes", sa.BigInteger(), nullable=True),
        sa.Column("gpus", sa.JSON(), nullable=False),
        sa.Column("net_rx_bytes", sa.BigInteger(), nullable=True),
        sa.Column("net_tx_bytes", sa.BigInteger(), nullable=True),
        sa.Column("disk_bytes", sa.BigInteger(), nullable=True),
        sa.Column("received_at", _TZ, nullable=False),
        sa.PrimaryKeyConstraint("node_id", "pod_id", "attempt", "seq"),
    )
    op.create_index("ix_usage_samples_node_time", "usage_samples", ["node_id", "time"])
    op.create_table(
        "pod_runs",
        sa.Column("pod_id", sa.String(length=32), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=True),
        sa.Column("node_id", sa.String(length=32), nullable=True),
        sa.Column("gpu_type", sa.String(length=64), nullable=True),
        sa.Column("gpus", sa.Float(), nullable=False),
        sa.Column("gpu_milli", sa.Integer(), nullable=False),
        sa.Column("mig_profile", sa.String(length=16), nullable=True),
        sa.Column("cpu_milli", sa.BigInteger(), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("volume_bytes", sa.BigInteger(), nullable=False),
        sa.Column("priority_class", sa.String(length=63), nullable=True),
        sa.Column("spot", sa.Boolean(), nullable=False),
        sa.Column("started_at", _TZ, nullable=False),
        sa.Column("ended_at", _TZ, nullable=True),
        sa.Column("end_reason", sa.String(length=200), nullable=True),
        sa.Column("credited", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("pod_id", "attempt"),
    )
    op.create_index("ix_pod_runs_project_started", "pod_runs", ["project_id", "started_at"])


def downgrade() -> None:
    op.drop_index("ix_pod_runs_project_started", table_name="pod_runs")
    op.drop_table("pod_runs")
    op.drop_index("ix_usage_samples_node_time", table_name="usage_samples")
    op.drop_table("usage_samples")
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("lease_renewed_at")
