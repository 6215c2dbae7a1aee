"""The OpenAPI document, made to tell the truth about what every route answers.

FastAPI documents a route's success response and, when it takes parameters, a 422 in its
own ``HTTPValidationError`` shape. gpucloud answers every error as ``ErrorOut``
(``{"detail": …, "field": …}``, see ``api.errors``), and more codes than FastAPI can see.
This module rewrites the generated document once, from what each operation declares, so
that a route added later is described without anyone remembering to:

- every error response is ``ErrorOut``;
- a route behind an API key or a node token (the security schemes ``ApiKey`` and
  ``NodeToken`` of ``api.deps``) answers 401, 403 and 429 (failures are rate-limited);
  an agent route also 404 (a pod that is not the node's) and 409 (a stale fencing token);
- a route with path parameters or a body (which may name other objects) answers 404;
- a route that changes state (any method but GET) answers 409;
- a route with a body answers 413 past the body limit (``api.limits``) and 422;
- what ``api.limits`` refuses in every JSON body is in the schemas: integers within
  BIGINT, strings and keys without NUL (except pod output, ``AgentLogChunkRequest``).

A route that declares a response itself (``responses=``) keeps its own description.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gpucloud.api.limits import INT64_MAX, INT64_MIN, MAX_PATH_SEGMENT, query_value_limit
from gpucloud.core.models import ErrorOut

_ERROR_REF = {"$ref": "#/components/schemas/ErrorOut"}
_DESCRIPTIONS = {
    401: "Missing or unknown credentials",
    403: "Known credentials that may not do this",
    404: "Not found, or not visible to the caller",
    409: "Conflicts with the current state (a duplicate name, a wrong phase, a stale token)",
    413: "The request body is larger than this route accepts",
    429: "Too many failed authentications from this address or for this key",
    422: "Invalid input; `field` names what was wrong",
}
_METHODS = ("get", "put", "post", "delete", "patch")


def error_codes(method: str, operation: dict[str, Any]) -> set[int]:
    """The error statuses an operation may answer, from its security, parameters and body."""
    schemes = {name for requirement in operation.get("security", []) for name in requirement}
    where = {parameter.get("in") for parameter in operation.get("parameters", [])}
    has_body = "requestBody" in operation
    codes: set[int] = set()
    if schemes:
        codes |= {401, 403, 429}
    if "path" in where or has_body or "NodeToken" in schemes:
        codes.add(404)
    if method != "get" or "NodeToken" in schemes:
        codes.add(409)  # agent reads check the fencing token too
    if has_body:
        codes |= {413, 422}
    if where & {"path", "query"}:
        codes.add(422)
    return codes


def _error_response(code: int) -> dict[str, Any]:
    return {"description": _DESCRIPTIONS[code],
            "content": {"application/json": {"schema": _ERROR_REF}}}


def _describe(operation: dict[str, Any], codes: set[int]) -> None:
    responses: dict[str, Any] = operation.setdefault("responses", {})
    if "401" in responses:
        codes = codes | {429}  # every authentication counts failures (services/ratelimit)
    for code in sorted(codes):
        existing = responses.get(str(code))
        if existing is None or _is_fastapi_validation(existing):
            responses[str(code)] = _error_response(code)


def _is_fastapi_validation(response: dict[str, Any]) -> bool:
    schema = response.get("content", {}).get("application/json", {}).get("schema", {})
    return bool(schema.get("$ref", "").endswith("/HTTPValidationError"))


def _drop_fastapi_validation(schema: dict[str, Any]) -> None:
    schemas = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)


def build(app: FastAPI) -> dict[str, Any]:
    """The document FastAPI generates, with every route's errors described."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description=app.description)
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {})["ErrorOut"] = ErrorOut.model_json_schema()
    for path_item in schema.get("paths", {}).values():
        for method in _METHODS:
            if method in path_item:
                _describe(path_item[method], error_codes(method, path_item[method]))
                _bound_parameters(path_item[method])
    _drop_fastapi_validation(schema)
    for name, model in components["schemas"].items():
        _bound_values(model, nul_allowed=name in _NUL_ALLOWED)
    return schema


#: Request bodies whose strings may hold NUL (``api.limits._NUL_ALLOWED``'s route).
_NUL_ALLOWED = {"AgentLogChunkRequest"}
NO_NUL = "^[^\\x00]*$"


#: A character of a URL at its worst: 4 bytes of UTF-8, each percent-encoded.
_WORST_BYTES_PER_CHARACTER = 12
#: The request line uvicorn's parser reads (httptools keeps a URL's parts in 16 bits).
REQUEST_LINE_BYTES = 65_535
#: What the HTTP server itself answers to a longer one, before the app sees it: documented
#: where a parameter's bound allows it (a job's log offsets, with characters outside their
#: grammar).
_REQUEST_LINE_TOO_LONG = {
    "description": "The request line is longer than the HTTP server reads (64 KiB): a "
                   "parameter of many non-ASCII characters, percent-encoded",
    "content": {"text/plain": {"schema": {"type": "string"}}}}


def _bound_parameters(operation: dict[str, Any]) -> None:
    """State on every string parameter the length ``api.limits.check_url`` enforces (a
    route's own, shorter bound stays)."""
    for parameter in operation.get("parameters", []):
        where = parameter.get("in")
        bound = (MAX_PATH_SEGMENT if where == "path"
                 else query_value_limit(parameter["name"]) if where == "query" else None)
        schema = parameter.get("schema", {})
        if "anyOf" in schema and "pattern" in schema:  # an optional string's own grammar
            pattern = schema.pop("pattern")
            for option in schema["anyOf"]:
                if option.get("type") == "string":
                    option["pattern"] = pattern
        for option in schema.get("anyOf", [schema]):
            if bound is not None and option.get("type") == "string" and "enum" not in option:
                option["maxLength"] = min(option.get("maxLength", bound), bound)
                if option["maxLength"] * _WORST_BYTES_PER_CHARACTER > REQUEST_LINE_BYTES:
                    operation["responses"]["400"] = _REQUEST_LINE_TOO_LONG


def _bound_values(node: Any, nul_allowed: bool) -> None:
    """Add what ``api.limits`` enforces to every integer and string schema in ``node``."""
    if isinstance(node, list):
        for item in node:
            _bound_values(item, nul_allowed)
        return
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    if kind == "integer":
        node.setdefault("minimum", INT64_MIN)
        node.setdefault("maximum", INT64_MAX)
    elif kind == "string" and not nul_allowed and not {"pattern", "enum", "format"} & set(node):
        node["pattern"] = NO_NUL
    elif kind == "object" and not nul_allowed and "additionalProperties" in node:
        node.setdefault("propertyNames", {"pattern": NO_NUL})
    for value in node.values():
        _bound_values(value, nul_allowed)


def install(app: FastAPI) -> None:
    """Serve :func:`build`'s document at ``/openapi.json`` (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
