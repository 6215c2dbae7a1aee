"""Engine and session factory for SQLite (embedded default) and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import CursorResult, Engine, Executable, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def default_database_url(home: Path) -> str:
    return f"sqlite:///{home / 'gpucloud.db'}"


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.close()


def _sqlite_begin(connection: Any) -> None:
    """Take SQLite's write lock at BEGIN, so a read-then-write transaction never fails
    half-way with SQLITE_BUSY; it waits for the lock (busy_timeout) instead. Read-only
    transactions (``Database.read``) begin deferred: in WAL mode they read a consistent
    snapshot without queueing behind writers."""
    read_only = connection.get_execution_options().get(_READ_ONLY, False)
    connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")


_READ_ONLY = "gpucloud_read_only"


def make_engine(url: str) -> Engine:
    """An engine tuned for the backend: WAL and a busy timeout on SQLite, a pool on PG."""
    if url.startswith("sqlite"):
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 10}, pool_size=8
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    return create_engine(url, pool_size=16, max_overflow=16, pool_recycle=3600)


def rows_changed(session: Session, statement: Executable) -> int:
    """Run a guarded UPDATE/DELETE and return how many rows it changed (0 = stale)."""
    result = session.execute(statement)
    assert isinstance(result, CursorResult)
    return int(result.rowcount)


_ON_COMMIT = "gpucloud.on_commit"


def on_commit(session: Session, callback: Callable[[], None]) -> None:
    """Run ``callback`` once the session's transaction has committed — never when it rolls
    back — so that what it announces (a wake-up) is already visible to readers."""
    session.info.setdefault(_ON_COMMIT, []).append(callback)


@event.listens_for(Session, "after_commit")
def _run_on_commit(session: Session) -> None:
    for callback in session.info.pop(_ON_COMMIT, []):
        callback()


@event.listens_for(Session, "after_rollback")
def _drop_on_commit(session: Session) -> None:
    session.info.pop(_ON_COMMIT, None)


class Database:
    """An engine and its session factory; ``transaction()`` commits or rolls back."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._read_sessions = sessionmaker(
            self.engine.execution_options(**{_READ_ONLY: True}), expire_on_commit=False
        )

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        with self._sessions() as session, session.begin():
            yield session

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A transaction that only reads (a consistent snapshot; never writes)."""
        with self._read_sessions() as session, session.begin():
            yield session

    def execute_atomic(self, statement: Executable, parameters: dict[str, Any]) -> None:
        """Run one statement as its own transaction, in a single round trip on PostgreSQL
        (autocommit: no BEGIN/COMMIT exchange). A constant ``statement`` with
        ``parameters`` is compiled once and reused."""
        with self.engine.connect() as connection:
            if self.is_sqlite:
                with connection.begin():
                    connection.execute(statement, parameters)
                return
            connection.execution_options(isolation_level="AUTOCOMMIT").execute(
                statement, parameters
            )

    def dispose(self) -> None:
        self.engine.dispose()
