"""MIG profiles, GPU shares, node MIG policy and GPU health

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa  # noqa: F401 - used as columns are added
from alembic import op  # noqa: F401

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


_SPEC_TABLES = ("pods", "jobs", "templates")


def _mig_upgrade() -> None:
    """MIG (helper mig): the spec's profile, a pod's slot and device, the node policy."""
    for table in _SPEC_TABLES:
        op.add_column(table, sa.Column("mig_profile", sa.String(length=16), nullable=True))
    op.add_column("pods", sa.Column("mig_slot", sa.Integer(), nullable=True))
    op.add_column("pods", sa.Column("mig_device", sa.JSON(), nullable=True))
    op.add_column("nodes", sa.Column("mig_policy", sa.String(length=16), nullable=True))


def _mig_downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("mig_policy")
    with op.batch_alter_table("pods") as batch:
        batch.drop_column("mig_device")
        batch.drop_column("mig_slot")
    for table in _SPEC_TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("mig_profile")


def _share_upgrade() -> None:
    """GPU shares and health (helper gpushare): a share's memory limit, a cordon's reason."""
    for table in _SPEC_TABLES:
        op.add_column(table, sa.Column("gpu_memory_bytes", sa.BigInteger(), nullable=True))
    op.add_column("nodes", sa.Column("cordon_reason", sa.String(length=500), nullable=True))


def _share_downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("cordon_reason")
    for table in _SPEC_TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("gpu_memory_bytes")


def upgrade() -> None:
    _mig_upgrade()
    _share_upgrade()


def downgrade() -> None:
    _share_downgrade()
    _mig_downgrade()
