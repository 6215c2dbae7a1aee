"""Migration 0018: the samples' ids compare bytewise on PostgreSQL (COLLATE "C": each
insert's key comparisons are a memcmp, not a strcoll). Alembic's schema comparison
(test_migrations.py) does not look at collations, so this checks the catalog."""

from __future__ import annotations

from sqlalchemy import text

from gpucloud.db.session import Database

_COLLATIONS = text(
    "SELECT column_name, collation_name FROM information_schema.columns "
    "WHERE table_name = 'usage_samples' AND column_name IN ('node_id', 'pod_id') "
    "ORDER BY column_name")


def test_the_sample_ids_are_collated_bytewise_on_postgresql(database_url: str) -> None:
    db = Database(database_url)
    try:
        if db.is_sqlite:  # SQLite's default collation (BINARY) is bytewise: nothing to do
            with db.engine.connect() as connection:
                sql = connection.execute(text(
                    "SELECT sql FROM sqlite_master WHERE name = 'usage_samples'")).scalar_one()
            assert "COLLATE" not in sql.upper()
            return
        with db.engine.connect() as connection:
            found = [tuple(row) for row in connection.execute(_COLLATIONS)]
        assert found == [("node_id", "C"), ("pod_id", "C")]
    finally:
        db.dispose()
