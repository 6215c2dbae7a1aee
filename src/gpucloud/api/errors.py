"""Mapping of the exception tree and of request validation to HTTP responses.

Every error body is ``{"detail": "<one readable line>", "field": <name or null>}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from gpucloud.core.errors import (
    Conflict,
    Forbidden,
    GpucloudError,
    InvalidInput,
    NotFound,
    Unauthorized,
)

_STATUS: list[tuple[type[GpucloudError], int]] = [
    (InvalidInput, 422),
    (NotFound, 404),
    (Conflict, 409),
    (Unauthorized, 401),
    (Forbidden, 403),
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
    if kind == "extra_forbidden":
        return field, f"unknown field {field!r}"
    if kind == "missing":
        return field, f"{field}: field required"
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return field, f"{field}: {message}"


def install(app: FastAPI) -> None:
    @app.exception_handler(GpucloudError)
    async def _gpucloud_error(_: Request, error: GpucloudError) -> JSONResponse:
        field = error.field if isinstance(error, InvalidInput) else None
        return _error_response(status_of(error), error.message, field)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        field, message = describe_validation(error.errors())
        return _error_response(422, message, field)
