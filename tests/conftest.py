"""Shared fixtures: databases (every DB test runs on SQLite and on PostgreSQL), a service
context with a manual clock, and an admin principal."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from gpucloud.core.clock import ManualClock
from gpucloud.core.settings import Settings
from gpucloud.db.migrate import upgrade
from gpucloud.db.models import Base
from gpucloud.db.session import Database
from gpucloud.services.context import ServiceContext
from tests.fixtures.postgres import postgres_server

ADMIN_KEY = "gpc_test-admin-key-0123456789"

#: Test directories, longest-running files first. ``make test`` hands whole files to its two
#: xdist workers in collection order (``--dist loadfile --no-loadscope-reorder``): the
#: minutes-long ones (a schemathesis run per database, faults and replicas with real lease
#: expiry, agents running containers) start first and the many short unit files fill the
#: tail, so neither worker idles at the end while the other finishes a long file. xdist's
#: own reordering (most tests first) put the single-test, longest files last.
LONGEST_FIRST = ("fuzz", "faults", "replicas", "e2e", "integration", "unit")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the items by ``LONGEST_FIRST`` directory (stable: file order kept within)."""
    root = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        try:
            directory = item.path.relative_to(root).parts[0]
        except ValueError:
            return len(LONGEST_FIRST)
        return LONGEST_FIRST.index(directory) if directory in LONGEST_FIRST \
            else len(LONGEST_FIRST)

    items.sort(key=rank)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """GPUCLOUD_TEST_POSTGRES_URL if set, else a server started for this test session."""
    preset = os.environ.get("GPUCLOUD_TEST_POSTGRES_URL")
    if preset:
        yield preset
        return
    with postgres_server() as url:
        yield url


@pytest.fixture(scope="session")
def _migrated() -> Iterator[dict[str, Database]]:
    databases: dict[str, Database] = {}
    yield databases
    for db in databases.values():
        db.dispose()


def _fresh(databases: dict[str, Database], backend: str, url: str) -> Database:
    """One migrated database per backend and session, emptied before each test."""
    if backend not in databases:
        db = Database(url)
        if not db.is_sqlite:
            with db.engine.begin() as connection:
                connection.exec_driver_sql("DROP SCHEMA IF EXISTS public CASCADE")
                connection.exec_driver_sql("CREATE SCHEMA public")
        upgrade(db.engine)
        databases[backend] = db
    db = databases[backend]
    tables = [t.name for t in reversed(Base.metadata.sorted_tables)]
    with db.engine.begin() as connection:
        if db.is_sqlite:
            for table in tables:
                connection.execute(text(f"DELETE FROM {table}"))
        else:
            connection.execute(text(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE"))
    return db


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                 _migrated: dict[str, Database]) -> str:
    """The URL of an empty, migrated database, once per backend."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.getbasetemp() / 'gpucloud-test.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    _fresh(_migrated, request.param, url)
    return url


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> Settings:
    return Settings(home=tmp_path / "home", database_url=database_url, admin_key=ADMIN_KEY,
                    restart_backoff_seconds=5.0)


@pytest.fixture
def ctx(settings: Settings, clock: ManualClock) -> Iterator[ServiceContext]:
    db = Database(settings.database_url)
    yield ServiceContext(db=db, clock=clock, settings=settings)
    db.dispose()
