"""``POST /graphql``: RunPod's GraphQL API over gpucloud's services (docs/runpod.md).

A real GraphQL implementation (graphql-core) parses and validates every document, so
inline literals (the ``runpod`` SDK's f-strings, quotes and all) and variables (runpodctl,
dstack) both work. A RunPod API key is a gpucloud project key, sent as
``Authorization: Bearer KEY``, a bare ``Authorization: KEY`` or ``?api_key=KEY``. Errors
come back as GraphQL does: HTTP 200 with ``{"errors": [{"message", "path"}]}``; only a
missing or wrong key is HTTP 401 (the SDK's AuthenticationError).
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from graphql import GraphQLError, graphql_sync
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from gpucloud.api.deps import authenticate_key
from gpucloud.compat.runpod import graphql_resolvers, graphql_schema
from gpucloud.compat.runpod.rest_common import key_of, wake
from gpucloud.core.errors import GpucloudError, Unauthorized
from gpucloud.core.models import ErrorOut
from gpucloud.services.context import ServiceContext

router = APIRouter(tags=["runpod"])
SCHEMA = graphql_resolvers.bind(graphql_schema.schema())
MAX_QUERY_CHARS = 256 * 1024


def api_key(request: Request) -> str | None:
    """The key from ``Authorization`` (with or without ``Bearer``) or ``?api_key=``."""
    return key_of(request.headers.get("authorization"), request.query_params.get("api_key"))


def _errors(*messages: str) -> dict[str, Any]:
    return {"errors": [{"message": m} for m in messages]}


def _error_out(error: GraphQLError) -> dict[str, Any]:
    """A GraphQL error; a service's error keeps its own one-line message."""
    original = error.original_error
    message = original.message if isinstance(original, GpucloudError) else error.message
    out: dict[str, Any] = {"message": message}
    if error.path:
        out["path"] = list(error.path)
    if error.locations:
        out["locations"] = [{"line": loc.line, "column": loc.column}
                            for loc in error.locations]
    return out


def _parse_body(raw: bytes) -> tuple[str, dict[str, Any] | None, str | None]:
    """(query, variables, operationName) of a GraphQL-over-HTTP JSON body."""
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError("the body is not JSON ({\"query\": …})") from None
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object with a 'query'")
    query, variables, operation = (body.get("query"), body.get("variables"),
                                   body.get("operationName"))
    if not isinstance(query, str) or not query.strip():
        raise ValueError("'query' must be a non-empty string")
    if len(query) > MAX_QUERY_CHARS:
        raise ValueError(f"'query' is longer than {MAX_QUERY_CHARS} characters")
    if variables is not None and not isinstance(variables, dict):
        raise ValueError("'variables' must be an object")
    if operation is not None and not isinstance(operation, str):
        raise ValueError("'operationName' must be a string")
    return query, variables, operation


def execute(context: graphql_resolvers.GqlContext, query: str,
            variables: dict[str, Any] | None, operation: str | None) -> dict[str, Any]:
    """Run one document (in a worker thread: resolvers call the blocking services)."""
    result = graphql_sync(SCHEMA, query, context_value=context, variable_values=variables,
                          operation_name=operation)
    out: dict[str, Any] = {}
    if result.errors:
        out["errors"] = [_error_out(e) for e in result.errors]
    if result.data is not None or not result.errors:
        out["data"] = result.data
    return out


class GraphqlErrorsOut(BaseModel):
    """What GraphQL servers answer on errors: ``{"errors": [{"message": …}]}``."""

    errors: list[dict[str, Any]]


_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["query"],
    "properties": {"query": {"type": "string", "minLength": 1, "pattern": "\\S",
                             "maxLength": MAX_QUERY_CHARS},
                   "variables": {"type": ["object", "null"]},
                   "operationName": {"type": ["string", "null"]}}}}}}}
_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The result: ``data``, and ``errors`` for failed fields"},
    400: {"model": GraphqlErrorsOut, "description": "The body is not a GraphQL request"},
    401: {"model": GraphqlErrorsOut, "description": "No key, or not a valid one"},
    413: {"model": ErrorOut, "description": "The body is too large"},
    422: {"model": ErrorOut, "description": "The body is not valid JSON text"},
    429: {"model": ErrorOut, "description": "Too many failed keys from this address"},
}


@router.post("/graphql", openapi_extra=_BODY, responses=_RESPONSES)
async def graphql_endpoint(request: Request) -> JSONResponse:
    ctx: ServiceContext = request.app.state.ctx
    try:
        caller = await authenticate_key(request, ctx, api_key(request))
    except Unauthorized as error:
        return JSONResponse(_errors(error.message), status_code=401)
    try:
        query, variables, operation = _parse_body(await request.body())
    except ValueError as error:
        return JSONResponse(_errors(str(error)), status_code=400)
    context = graphql_resolvers.GqlContext(ctx=ctx, caller=caller,
                                           wake=partial(wake, request))
    out = await run_in_threadpool(execute, context, query, variables, operation)
    return JSONResponse(out)
