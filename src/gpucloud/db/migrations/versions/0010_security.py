"""security: join token use and revocation

A join token may be limited to a number of registrations (``max_uses``, NULL for any
number until it expires), counts them (``uses``), can be revoked (``revoked_at``), and
keeps its printed prefix so that an admin can name it.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("join_tokens", sa.Column("prefix", sa.String(length=16), nullable=True))
    op.add_column("join_tokens", sa.Column("max_uses", sa.Integer(), nullable=True))
    op.add_column("join_tokens", sa.Column("uses", sa.Integer(), nullable=False,
                                           server_default="0"))
    op.add_column("join_tokens", sa.Column("revoked_at", sa.DateTime(timezone=True),
                                           nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("join_tokens") as batch:
        batch.drop_column("revoked_at")
        batch.drop_column("uses")
        batch.drop_column("max_uses")
        batch.drop_column("prefix")
