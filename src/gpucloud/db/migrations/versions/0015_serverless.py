"""serverless endpoints: endpoints, their durable request queue, worker pods

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_TZ = sa.DateTime(timezone=True)


def _container_spec_columns() -> list[sa.Column[object]]:
    """``db.models.ContainerSpecColumns`` as they stand at 0015 (one spec)."""
    return [
        sa.Column("image", sa.String(length=255), nullable=False),
        sa.Column("command", sa.JSON(), nullable=False),
        sa.Column("env", sa.JSON(), nullable=False),
        sa.Column("gpu_type", sa.String(length=64), nullable=True),
        sa.Column("cpu_milli", sa.BigInteger(), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("entrypoint", sa.JSON(), nullable=True),
        sa.Column("volume_bytes", sa.BigInteger(), nullable=True),
        sa.Column("volume_path", sa.String(length=255), nullable=True),
        sa.Column("container_disk_bytes", sa.BigInteger(), nullable=True),
        sa.Column("network_volumes", sa.JSON(), nullable=True),
        sa.Column("registry_auth", sa.String(length=63), nullable=True),
        sa.Column("spot", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("bid", sa.Float(), nullable=True),
        sa.Column("grace_seconds", sa.Float(), nullable=True),
        sa.Column("checkpoint_dir", sa.String(length=255), nullable=True),
        sa.Column("checkpoint_signal", sa.String(length=16), nullable=True),
        sa.Column("checkpoint_mode", sa.String(length=16), nullable=True),
        sa.Column("mig_profile", sa.String(length=16), nullable=True),
        sa.Column("gpu_memory_bytes", sa.BigInteger(), nullable=True),
    ]


def _endpoints() -> None:
    op.create_table(
        "endpoints",
        sa.Column("id", sa.String(length=32), primary_key=True),
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("ports", sa.JSON(), nullable=False),
        sa.Column("gpus", sa.Float(), nullable=False),
        sa.Column("gpu_ids", sa.String(length=255), nullable=True),
        sa.Column("min_workers", sa.Integer(), nullable=False),
        sa.Column("max_workers", sa.Integer(), nullable=False),
        sa.Column("idle_timeout_seconds", sa.Float(), nullable=False),
        sa.Column("scaler", sa.String(length=16), nullable=False),
        sa.Column("scaler_value", sa.Integer(), nullable=False),
        sa.Column("execution_timeout_seconds", sa.Float(), nullable=False),
        sa.Column("max_retries", sa.Integer(), nullable=False),
        sa.Column("template", sa.String(length=63), nullable=True),
        sa.Column("created_at", _TZ, nullable=False),
        sa.Column("updated_at", _TZ, nullable=False),
        sa.Column("deleted_at", _TZ, nullable=True),
        sa.Column("version", sa.BigInteger(), nullable=False),
        *_container_spec_columns(),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
    )
    op.create_index("uq_endpoints_project_name_live", "endpoints", ["project_id", "name"],
                    unique=True, sqlite_where=sa.text("deleted_at IS NULL"),
                    postgresql_where=sa.text("deleted_at IS NULL"))


def _requests() -> None:
    op.create_table(
        "endpoint_requests",
        sa.Column("id", sa.String(length=48), primary_key=True),
        sa.Column("endpoint_id", sa.String(length=32), nullable=False),
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("input", sa.JSON(), nullable=False),
        sa.Column("output", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("sync", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("execution_timeout_seconds", sa.Float(), nullable=True),
        sa.Column("worker_pod_id", sa.String(length=32), nullable=True),
        sa.Column("lease_expires_at", _TZ, nullable=True),
        sa.Column("retries", sa.Integer(), nullable=False),
        sa.Column("stream", sa.JSON(), nullable=True),
        sa.Column("stream_done", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("webhook", sa.String(length=2048), nullable=True),
        sa.Column("webhook_state", sa.String(length=16), nullable=True),
        sa.Column("webhook_attempts", sa.Integer(), nullable=False),
        sa.Column("webhook_next_at", _TZ, nullable=True),
        sa.Column("created_at", _TZ, nullable=False),
        sa.Column("started_at", _TZ, nullable=True),
        sa.Column("finished_at", _TZ, nullable=True),
        sa.Column("expires_at", _TZ, nullable=True),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["endpoint_id"], ["endpoints.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["worker_pod_id"], ["pods.id"], ondelete="SET NULL"),
    )
    op.create_index("ix_endpoint_requests_queue", "endpoint_requests",
                    ["endpoint_id", "status", "created_at"])
    op.create_index("ix_endpoint_requests_worker", "endpoint_requests",
                    ["worker_pod_id", "status"])
    op.create_index("ix_endpoint_requests_expires", "endpoint_requests", ["expires_at"])


def _workers() -> None:
    with op.batch_alter_table("pods") as batch:
        batch.add_column(sa.Column("endpoint_id", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("worker_idle_since", _TZ, nullable=True))
        batch.create_foreign_key("fk_pods_endpoint_id", "endpoints", ["endpoint_id"], ["id"],
                                 ondelete="CASCADE")
        batch.create_index("ix_pods_endpoint_id", ["endpoint_id"])


def _key_scope() -> None:
    op.add_column("api_keys", sa.Column("scope", sa.String(length=63), nullable=True))


def upgrade() -> None:
    _endpoints()
    _requests()
    _workers()
    _key_scope()


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("scope")
    with op.batch_alter_table("pods") as batch:
        batch.drop_index("ix_pods_endpoint_id")
        batch.drop_constraint("fk_pods_endpoint_id", type_="foreignkey")
        batch.drop_column("worker_idle_since")
        batch.drop_column("endpoint_id")
    op.drop_table("endpoint_requests")
    op.drop_table("endpoints")
