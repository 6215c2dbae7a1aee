"""The migrations build exactly the schema the models describe, on both databases, and
applying them again is a no-op."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from gpucloud.db.migrate import upgrade
from gpucloud.db.models import Base
from gpucloud.db.session import Database


def test_migrated_schema_matches_the_models(database_url: str) -> None:
    db = Database(database_url)
    try:
        upgrade(db.engine)
        with db.engine.connect() as connection:
            diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
        assert diff == []
    finally:
        db.dispose()
