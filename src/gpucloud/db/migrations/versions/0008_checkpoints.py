"""checkpoints and their store: the spec's checkpoint directory, committed checkpoints,
open uploads (whose chunks the collector keeps)

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_TZ = sa.DateTime(timezone=True)
_SPEC_TABLES = ("pods", "jobs", "templates")


def upgrade() -> None:
    for table in _SPEC_TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("checkpoint_dir", sa.String(length=255),
                                          nullable=True))
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("key", sa.String(length=80), nullable=False),
        sa.Column("pod_id", sa.String(length=32), nullable=True),
        sa.Column("node_id", sa.String(length=32), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("manifest", sa.String(length=255), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("chunks", sa.Integer(), nullable=False),
        sa.Column("bytes_sent", sa.BigInteger(), nullable=False),
        sa.Column("cost_seconds", sa.Float(), nullable=True),
        sa.Column("digests", sa.JSON(), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("created_at", _TZ, nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["pod_id"], ["pods.id"], ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("project_id", "key", "attempt", "seq",
                            name="uq_checkpoints_key_attempt_seq"),
    )
    op.create_index("ix_checkpoints_pod", "checkpoints", ["pod_id"])
    op.create_table(
        "checkpoint_uploads",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("key", sa.String(length=80), nullable=False),
        sa.Column("pod_id", sa.String(length=32), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("digests", sa.JSON(), nullable=False),
        sa.Column("created_at", _TZ, nullable=False),
        sa.Column("expires_at", _TZ, nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["pod_id"], ["pods.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("checkpoint_uploads")
    op.drop_index("ix_checkpoints_pod", table_name="checkpoints")
    op.drop_table("checkpoints")
    for table in reversed(_SPEC_TABLES):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("checkpoint_dir")
