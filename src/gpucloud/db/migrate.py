"""Apply Alembic migrations programmatically (the server does it at start)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, text

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def alembic_config(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["engine"] = engine
    return config


#: The PostgreSQL advisory lock key replicas starting together migrate under.
MIGRATION_LOCK = 0x67707563  # "gpuc"


def upgrade(engine: Engine) -> None:
    """Bring the schema to the newest revision; a no-op when it already is. On
    PostgreSQL under an advisory lock: replicas starting at once migrate one at a time."""
    if engine.dialect.name == "sqlite":
        command.upgrade(alembic_config(engine), "head")
        return
    with engine.connect() as lock:
        lock.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK})
        try:
            command.upgrade(alembic_config(engine), "head")
        finally:
            lock.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK})
