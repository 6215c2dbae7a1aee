"""Engine and session factory for SQLite (embedded default) and PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import CursorResult, Engine, Executable, Row, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DisconnectionError
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


def libpq_params(url: str) -> dict[str, Any]:
    """The libpq connection parameters of a PostgreSQL SQLAlchemy ``url``, translated as
    the engine's dialect translates them: a multi-host URL (``?host=h1:p1&host=h2:p2
    &target_session_attrs=read-write``, which follows a failover) gives ``host="h1,h2"``
    and ``port="p1,p2"``; so that a connection opened with psycopg itself
    (``psycopg.conninfo.make_conninfo("", **params)``) goes where the engine's go."""
    parsed = make_url(url).set(drivername="postgresql+psycopg")
    _args, params = parsed.get_dialect()().create_connect_args(parsed)
    params.pop("context", None)  # the dialect's psycopg adapters, not a libpq parameter
    return dict(params)


#: The request pool's connections on PostgreSQL: all kept once opened (no overflow).
POOL_SIZE = 32


def make_engine(url: str, pool_size: int = POOL_SIZE, max_overflow: int = 0,
                pool_timeout: float = 30.0, connect_args: dict[str, Any] | None = None) -> Engine:
    """An engine tuned for the backend: WAL and a busy timeout on SQLite, a pool on PG
    (its size, wait and connection options as given: a path with a pool of its own, the
    lease renewals', asks for a small one that answers fast).

    The request pool keeps every connection it opens, up to ``POOL_SIZE``, and opens no
    overflow: an overflow connection is closed as soon as it is returned to a full pool,
    so a replica whose concurrent requests hover above the kept size opened and closed
    PostgreSQL sessions all the time (26 a second with 4,000 agents polling, each a
    backend forked and its catalog caches filled again, on both sides' CPU). The same
    ceiling as the 16 kept + 16 overflow before; a checkout past it waits as before."""
    if url.startswith("sqlite"):
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 10}, pool_size=8
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    engine = create_engine(url, pool_size=pool_size, max_overflow=max_overflow,
                           pool_timeout=pool_timeout, pool_recycle=3600,
                           connect_args=connect_args or {})
    event.listen(engine, "checkin", _mark_idle)
    event.listen(engine, "checkout", _ping_if_idle)
    return engine


#: A pooled connection idle for longer than this is pinged before use (PostgreSQL).
PING_AFTER_IDLE_SECONDS = 5.0
_IDLE_SINCE = "gpucloud_idle_since"


def _mark_idle(_dbapi_connection: Any, record: Any) -> None:
    if record is not None:
        record.info[_IDLE_SINCE] = time.monotonic()


def _ping_if_idle(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
    """Reconnect by itself after a PostgreSQL restart or failover, without the round trip
    ``pool_pre_ping`` costs on every checkout (a lease renewal is one statement).

    A connection that sat idle in the pool is pinged first; a dead one raises
    DisconnectionError, on which the pool opens a fresh one. A busy connection is not:
    if its server died, the statement that finds out fails (503, api/errors.py), and
    SQLAlchemy, seeing a disconnect, invalidates every connection opened before it, so
    the pool is renewed after the first failure, not one request per connection."""
    idle_since = record.info.get(_IDLE_SINCE)
    if idle_since is None or time.monotonic() - idle_since < PING_AFTER_IDLE_SECONDS:
        return
    try:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("SELECT 1")
        finally:
            cursor.close()
        dbapi_connection.rollback()  # leave no transaction open behind the ping
    except Exception as error:  # noqa: BLE001 - any failure means: not usable
        raise DisconnectionError(f"idle connection is gone: {error}") from error


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

    def __init__(self, url: str, **pool: Any) -> None:
        """``pool``: ``make_engine``'s pool options (PostgreSQL)."""
        self.url = url
        self.engine = make_engine(url, **pool)
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

    def first_atomic(self, statement: Executable,
                     parameters: dict[str, Any] | None = None) -> Row[Any] | None:
        """The first row of one statement (an ``UPDATE … RETURNING``) run as its own
        transaction: a single round trip on PostgreSQL (autocommit), BEGIN IMMEDIATE on
        SQLite."""
        with self.engine.connect() as connection:
            if self.is_sqlite:
                with connection.begin():
                    return connection.execute(statement, parameters).first()
            return connection.execution_options(isolation_level="AUTOCOMMIT").execute(
                statement, parameters).first()

    def guarded(self, guard: Callable[[Session], None]) -> Database:
        """The same database whose every ``transaction()`` first runs ``guard`` (the
        controller leader's fencing check, services/leadership.py); reads are not
        guarded. Shares this one's engine; disposing it leaves the engine open."""
        return _GuardedDatabase(self, guard)

    def dispose(self) -> None:
        self.engine.dispose()


class _GuardedDatabase(Database):
    def __init__(self, inner: Database, guard: Callable[[Session], None]) -> None:
        self.url = inner.url
        self.engine = inner.engine
        self._sessions = inner._sessions
        self._read_sessions = inner._read_sessions
        self._guard = guard

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        with super().transaction() as session:
            self._guard(session)
            yield session

    def dispose(self) -> None:
        pass
