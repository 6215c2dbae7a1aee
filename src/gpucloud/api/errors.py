"""Mapping of the exception tree and of request validation to HTTP responses.

Every error body is ``{"detail": "<one readable line>", "field": <name or null>}``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpucloud.core.errors import (
    Conflict,
    Forbidden,
    GpucloudError,
    InvalidInput,
    NotFound,
    Unauthorized,
)
from gpucloud.services.ratelimit import RateLimited

_STATUS: list[tuple[type[GpucloudError], int]] = [
    (InvalidInput, 422),
    (NotFound, 404),
    (Conflict, 409),
    (Unauthorized, 401),
    (Forbidden, 403),
    (RateLimited, 429),
]


def status_of(error: GpucloudError) -> int:
    for kind, code in _STATUS:
        if isinstance(error, kind):
            return code
    return 400


def _error_response(code: int, detail: str, field: str | None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if code == 401 else None
    return JSONResponse({"detail": detail, "field": field}, status_code=code, headers=headers)


def _field_name(loc: Sequence[Any]) -> str:
    """``("body", "env", "A")`` → ``env.A``; drops the request part FastAPI puts first."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def describe_validation(errors: Sequence[Any]) -> tuple[str, str]:
    """The first validation error as (field, one-line message)."""
    first = errors[0]
    field = _field_name(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "body", f"body: not valid JSON ({first.get('msg', 'invalid')})"
    if kind == "extra_forbidden":
        return field, f"unknown field {field!r}"
    if kind == "missing":
        return field, f"{field}: field required"
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return field, f"{field}: {message}"


def _allowed_methods(request: Request) -> str:
    """The methods the OpenAPI document lists for this path (Starlette names only those of
    the first route that matches). A literal path wins over a template: ``/v1/nodes/join-tokens``
    is not ``/v1/nodes/{ref}``."""
    paths: dict[str, dict[str, Any]] = request.app.openapi().get("paths", {})
    matches = [template for template in paths
               if re.fullmatch(re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)),
                               request.url.path)]
    literal = [template for template in matches if "{" not in template]
    methods = {method.upper() for template in (literal or matches) for method in paths[template]}
    return ", ".join(sorted(methods))


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own errors in the one shape: an unparsable body is bad input
    (422 naming ``body``), a 405 lists every method of the path."""
    if error.status_code == 400:
        return _error_response(422, "body: could not be parsed as JSON", "body")
    field = "body" if error.status_code == 413 else None
    response = _error_response(error.status_code, str(error.detail), field)
    if error.headers:  # e.g. a 503's Retry-After
        response.headers.update(error.headers)
    if error.status_code == 405:
        response.headers["Allow"] = _allowed_methods(request)
    return response


#: Seconds a client is told to wait when the database cannot be reached.
DATABASE_RETRY_AFTER_SECONDS = 2
#: PostgreSQL's SQLSTATE for a statement cut by ``statement_timeout`` (query_canceled).
_STATEMENT_CUT = "57014"
#: PostgreSQL's SQLSTATE for a write on a server that takes none (read_only_sql_transaction).
_READ_ONLY = "25006"


def database_unavailable(error: SQLAlchemyError) -> bool:
    """Whether a database error means "cannot reach the database now" (refused, cut, shut
    down, or every pooled connection busy), not a bug in the statement: the DB-API's own
    OperationalError and InterfaceError are exactly those."""
    if isinstance(error, (OperationalError, InterfaceError, PoolTimeout)):
        return True
    if _sqlstate(error) == _READ_ONLY:
        return True  # a standby, or a primary being demoted: the failover is under way
    return isinstance(error, DBAPIError) and error.connection_invalidated


def unavailable_detail(error: SQLAlchemyError) -> str:
    """What a 503 says: a busy replica (no pooled connection free in time) or a busy
    database (a statement cut at its timeout) are not a database that is down, and an
    operator reading the answer should not go looking for one."""
    if isinstance(error, PoolTimeout):
        return "the server is busy (no database connection free); retry shortly"
    state = _sqlstate(error)
    if state == _STATEMENT_CUT:
        return "the database is busy (the statement timed out); retry shortly"
    if state == _READ_ONLY:
        return "the database is read-only (a failover is under way?); retry shortly"
    return "the database is unavailable; retry shortly"


def _sqlstate(error: SQLAlchemyError) -> str | None:
    """The PostgreSQL SQLSTATE behind ``error`` (psycopg's), if it carries one."""
    state = getattr(getattr(error, "orig", None), "sqlstate", None)
    return state if isinstance(state, str) else None


async def _database_error(_: Request, error: SQLAlchemyError) -> JSONResponse:
    """The database is down or restarting: 503 with Retry-After, never a 500 trace; the
    pool has dropped the dead connections, so the next request reconnects by itself."""
    if not database_unavailable(error):
        raise error
    response = _error_response(503, unavailable_detail(error), None)
    response.headers["Retry-After"] = str(DATABASE_RETRY_AFTER_SECONDS)
    return response


def install(app: FastAPI) -> None:
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(SQLAlchemyError, _database_error)  # type: ignore[arg-type]

    @app.exception_handler(GpucloudError)
    async def _gpucloud_error(_: Request, error: GpucloudError) -> JSONResponse:
        field = error.field if isinstance(error, InvalidInput) else None
        response = _error_response(status_of(error), error.message, field)
        if isinstance(error, RateLimited):
            response.headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_seconds)))
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        field, message = describe_validation(error.errors())
        return _error_response(422, message, field)
