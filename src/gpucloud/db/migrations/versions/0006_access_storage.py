"""pods people work in: SSH keys, agent access endpoints, pod networks and ports,
volumes, network volumes, templates, registry credentials

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_TZ = sa.DateTime(timezone=True)


def _project_fk() -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE")


def _spec_columns() -> list[sa.Column[object]]:
    """What a pod, a job and a template carry beyond their own columns (one spec)."""
    return [
        sa.Column("entrypoint", sa.JSON(), nullable=True),
        sa.Column("volume_bytes", sa.BigInteger(), nullable=True),
        sa.Column("volume_path", sa.String(length=255), nullable=True),
        sa.Column("container_disk_bytes", sa.BigInteger(), nullable=True),
        sa.Column("network_volumes", sa.JSON(), nullable=True),
        sa.Column("registry_auth", sa.String(length=63), nullable=True),
    ]


def upgrade() -> None:
    op.create_table(
        "ssh_keys",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("key_type", sa.String(length=64), nullable=False),
        sa.Column("public_key", sa.Text(), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("created_at", _TZ, nullable=False),
        _project_fk(),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("project_id", "fingerprint", name="uq_ssh_keys_project_fp"),
    )
    op.create_table(
        "volumes",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("zone", sa.String(length=63), nullable=True),
        sa.Column("created_at", _TZ, nullable=False),
        _project_fk(),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("project_id", "name", name="uq_volumes_project_name"),
    )
    op.create_table(
        "registry_auths",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("registry_host", sa.String(length=255), nullable=True),
        sa.Column("username", sa.String(length=255), nullable=False),
        sa.Column("password", sa.Text(), nullable=False),
        sa.Column("created_at", _TZ, nullable=False),
        _project_fk(),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("project_id", "name", name="uq_registry_auths_project_name"),
    )
    op.create_table(
        "templates",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("project_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("image", sa.String(length=255), nullable=False),
        sa.Column("command", sa.JSON(), nullable=False),
        sa.Column("env", sa.JSON(), nullable=False),
        sa.Column("ports", sa.JSON(), nullable=False),
        sa.Column("gpus", sa.Float(), nullable=False),
        sa.Column("gpu_type", sa.String(length=64), nullable=True),
        sa.Column("cpu_milli", sa.BigInteger(), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
        *_spec_columns(),
        sa.Column("created_at", _TZ, nullable=False),
        _project_fk(),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("project_id", "name", name="uq_templates_project_name"),
    )
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("access_endpoint", sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column("access_host_key", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("network_mode", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("volume_mode", sa.String(length=16), nullable=True))
    with op.batch_alter_table("pods", schema=None) as batch_op:
        for column in _spec_columns():
            batch_op.add_column(column)
        batch_op.add_column(sa.Column("template", sa.String(length=63), nullable=True))
        batch_op.add_column(sa.Column("network", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("proxy_token", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("volume_node_id", sa.String(length=32), nullable=True))
        batch_op.create_foreign_key("fk_pods_volume_node_id_nodes", "nodes",
                                    ["volume_node_id"], ["id"], ondelete="SET NULL")
        batch_op.add_column(sa.Column("volume_source_node_id", sa.String(length=32),
                                      nullable=True))
        batch_op.create_foreign_key("fk_pods_volume_source_node_id_nodes", "nodes",
                                    ["volume_source_node_id"], ["id"], ondelete="SET NULL")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        for column in _spec_columns():
            batch_op.add_column(column)


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        for column in _spec_columns():
            batch_op.drop_column(column.name)
    with op.batch_alter_table("pods", schema=None) as batch_op:
        batch_op.drop_constraint("fk_pods_volume_source_node_id_nodes", type_="foreignkey")
        batch_op.drop_constraint("fk_pods_volume_node_id_nodes", type_="foreignkey")
        for name in ("volume_source_node_id", "volume_node_id", "proxy_token", "network",
                     "template"):
            batch_op.drop_column(name)
        for column in _spec_columns():
            batch_op.drop_column(column.name)
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        for name in ("volume_mode", "network_mode", "access_host_key", "access_endpoint"):
            batch_op.drop_column(name)
    for table in ("templates", "registry_auths", "volumes", "ssh_keys"):
        op.drop_table(table)
