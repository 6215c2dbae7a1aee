"""prices, spend limits and credit

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "prices",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("resource", sa.String(length=16), nullable=False),
        sa.Column("gpu_model", sa.String(length=64), nullable=False),
        sa.Column("mig_profile", sa.String(length=16), nullable=False),
        sa.Column("price_class", sa.String(length=16), nullable=False),
        sa.Column("micros", sa.BigInteger(), nullable=False),
        sa.Column("effective_at", _TZ, nullable=False),
        sa.Column("created_at", _TZ, nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("resource", "gpu_model", "mig_profile", "price_class",
                            "effective_at", name="uq_prices_key_effective"),
    )
    op.create_table(
        "spend_limits",
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("per_hour_micros", sa.BigInteger(), nullable=True),
        sa.Column("credit_micros", sa.BigInteger(), nullable=True),
        sa.Column("credit_since", _TZ, nullable=True),
        sa.Column("exhausted_at", _TZ, nullable=True),
        sa.Column("updated_at", _TZ, nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("project_id"),
    )


def downgrade() -> None:
    op.drop_table("spend_limits")
    op.drop_table("prices")
