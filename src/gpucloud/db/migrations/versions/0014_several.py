"""several server replicas: no schema change

The controller lease (``controller_leases``: holder, expires_at, token as the epoch) is
from 0001; replicas need no new column. Kept so the revision chain stays numbered.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa  # noqa: F401 - used as columns are added
from alembic import op  # noqa: F401

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
