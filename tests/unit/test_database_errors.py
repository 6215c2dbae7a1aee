"""A database error is a 503 with Retry-After that says which kind of busy it is: a
replica short of pooled connections, a statement cut at its timeout, or a database that
cannot be reached; any other database error is a bug and stays a 500."""

from __future__ import annotations

import psycopg
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.exc import IntegrityError, InternalError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from gpucloud.api import errors


def _cut() -> OperationalError:
    """What psycopg raises for a statement cut by ``statement_timeout``, as SQLAlchemy
    wraps it."""
    return OperationalError("SELECT 1", {}, psycopg.errors.QueryCanceled(
        "canceling statement due to statement timeout"))


def _app(raised: Exception) -> TestClient:
    app = FastAPI()
    errors.install(app)

    @app.get("/boom")
    def boom() -> None:
        raise raised

    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize(("raised", "detail"), [
    (PoolTimeout("QueuePool limit of size 32 overflow 0 reached"),
     "the server is busy (no database connection free); retry shortly"),
    (_cut(), "the database is busy (the statement timed out); retry shortly"),
    (OperationalError("SELECT 1", {}, psycopg.OperationalError("connection refused")),
     "the database is unavailable; retry shortly"),
    # A pooled connection to a server that became (or still is) a standby: psycopg's
    # InternalError, not an OperationalError, yet the failover's to wait out.
    (InternalError("INSERT", {}, psycopg.errors.ReadOnlySqlTransaction(
        "cannot execute INSERT in a read-only transaction")),
     "the database is read-only (a failover is under way?); retry shortly"),
])
def test_each_kind_of_busy_is_a_503_saying_which(raised: Exception, detail: str) -> None:
    response = _app(raised).get("/boom")
    assert response.status_code == 503
    assert response.headers["Retry-After"] == str(errors.DATABASE_RETRY_AFTER_SECONDS)
    assert response.json() == {"detail": detail, "field": None}


def test_a_statement_error_is_not_mistaken_for_a_busy_database() -> None:
    raised = IntegrityError("INSERT", {}, psycopg.errors.UniqueViolation("duplicate"))
    assert _app(raised).get("/boom").status_code == 500
