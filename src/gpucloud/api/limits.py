"""Limits every request body meets before a router sees it: its size, and values no
database column can hold.

The size limit answers 413 in the one error shape, before a large body is read.

1 MiB is far above any API request a person sends (a container spec with 512 variables
and 1,024 arguments fits); the agent protocol ships log chunks of up to 1 MiB of text,
which JSON escaping can grow several times, so ``/v1/agent/`` routes get more. The limit
is checked against ``Content-Length`` first and then counted as the body streams in, so a
chunked upload cannot slip past it.

A JSON body is then checked as a whole, whatever route it is for, so a route added later
is covered too (422 naming the field, as pydantic's own errors): every integer within
PostgreSQL's BIGINT, every number finite (Python's JSON reads ``NaN`` and ``1e999``), and no
NUL character in any string or key (PostgreSQL's text cannot store one; SQLite can, so
without this the same request would work on one database and fail on the other). Pod
output is the exception: a program may print NUL, and the agent's log route keeps it
(the log service stores it as a space, same byte length).

The URL is bounded the same way, before routing, so that no route's path or query
parameter is an unbounded string: a path segment (a name, an id) has at most
``MAX_PATH_SEGMENT`` characters and a query value at most ``query_value_limit`` (422 naming
the parameter, or ``path``); the OpenAPI document states both bounds (api/openapi.py).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any
from urllib.parse import parse_qsl

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_BODY_LIMIT = 1024 * 1024
#: The longest path segment: every name and id the API takes is far shorter (names 63).
MAX_PATH_SEGMENT = 256
#: The longest query value (names, times, filters), and the longer ones some parameters
#: need: a job's log ``offsets``, up to 1,024 ``RANK:ATTEMPT:OFFSET`` positions (ASCII by
#: its pattern). The bounds leave the worst URL (every character percent-encoded UTF-8,
#: 12 bytes) inside the 64 KiB request line the HTTP server reads: past that a client
#: gets the server's bare 400, not this module's 422.
MAX_QUERY_VALUE = 1024
LONG_QUERY_VALUES = {"offsets": 32 * 1024}

AGENT_BODY_LIMIT = 16 * 1024 * 1024
AGENT_PREFIX = "/v1/agent/"
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
#: Routes whose strings may carry NUL: pod output.
_NUL_ALLOWED = re.compile(r"^/v1/agent/pods/[^/]+/logs$")
#: Routes whose models and service make the same checks themselves, off the event loop
#: (usage batches: thousands of values each; api/usage_admission.py, core/usage.py).
CHECKED_BY_ROUTE = frozenset({"/v1/agent/usage"})
_JSON_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


def query_value_limit(name: str) -> int:
    """The most characters query parameter ``name`` may hold."""
    return LONG_QUERY_VALUES.get(name, MAX_QUERY_VALUE)


def body_limit(path: str) -> int:
    """The largest request body, in bytes, that ``path`` accepts."""
    return AGENT_BODY_LIMIT if path.startswith(AGENT_PREFIX) else DEFAULT_BODY_LIMIT


def too_large_detail(limit: int) -> str:
    return f"request body is larger than {limit // 1024} KiB"


class BodyLimitMiddleware:
    """Refuse HTTP request bodies past :func:`body_limit` with 413."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        url_problem = check_url(scope["path"], scope.get("query_string", b""))
        if url_problem is not None:
            await _send_error(send, 422, url_problem[1], url_problem[0])
            return
        limit = body_limit(scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _send_error(send, 413, too_large_detail(limit))
            return
        receive = _counting(receive, limit)
        if (scope["method"] in _JSON_METHODS and _is_json(scope)
                and scope["path"] not in CHECKED_BY_ROUTE):
            try:
                body = await read_body(receive)
            except HTTPException as error:
                await _send_error(send, error.status_code, str(error.detail))
                return
            problem = check_json_body(body, nul_allowed=bool(_NUL_ALLOWED.match(scope["path"])))
            if problem is not None:
                await _send_error(send, 422, problem[1], problem[0])
                return
            receive = replay_body(body, receive)
        await self.app(scope, receive, send)


def check_url(path: str, query_string: bytes) -> tuple[str, str] | None:
    """(field, message) when a path segment or a query value is past its bound; None
    when none is. ``path`` is decoded already (ASGI); the query is decoded here, as the
    router will (an undecodable one is left to it)."""
    if len(path) > MAX_PATH_SEGMENT and any(  # on every request: the short path first
            len(segment) > MAX_PATH_SEGMENT for segment in path.split("/")):
        return "path", f"path: a segment is longer than {MAX_PATH_SEGMENT} characters"
    if len(query_string) <= MAX_QUERY_VALUE:
        return None  # no value can be longer than the whole query
    try:
        pairs = parse_qsl(query_string.decode("latin-1"), keep_blank_values=True)
    except ValueError:
        return None
    for name, value in pairs:
        if len(value) > (limit := query_value_limit(name)):
            return name, f"{name}: at most {limit} characters"
    return None


def check_json_body(body: bytes, nul_allowed: bool = False) -> tuple[str, str] | None:
    """(field, message) of the first value in a JSON body that no column can hold; None
    when there is none, or when the body is not JSON at all (the router says so)."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    return _first_problem(document, (), nul_allowed)


def _first_problem(value: Any, path: tuple[str, ...],
                   nul_allowed: bool) -> tuple[str, str] | None:
    field = ".".join(path) or "body"
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            return field, f"{field}: must be between -2^63 and 2^63-1"
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else (field, f"{field}: must be a finite number")
    if isinstance(value, str):
        if "\x00" in value and not nul_allowed:
            return field, f"{field}: must not contain a NUL character"
        return None
    if isinstance(value, list):
        items: list[tuple[str, Any]] = [(str(i), item) for i, item in enumerate(value)]
    else:
        items = list(value.items())
    for key, item in items:
        if "\x00" in key and not nul_allowed:
            return field, f"{field}: a key must not contain a NUL character"
        problem = _first_problem(item, (*path, key), nul_allowed)
        if problem is not None:
            return problem
    return None


def _is_json(scope: Scope) -> bool:
    for name, value in scope.get("headers", []):
        if name == b"content-type":
            return b"json" in value.lower()
    return False


async def read_body(receive: Receive) -> bytes:
    """The whole request body, from its ASGI messages (also api/agent_fast.py)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """The body once, as one message; then whatever the client sends (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _counting(receive: Receive, limit: int) -> Receive:
    """``receive`` that raises 413 (mapped by ``api.errors``) once the body passes ``limit``."""
    seen = 0

    async def counted() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise HTTPException(413, too_large_detail(limit))
        return message

    return counted


async def _send_error(send: Send, status: int, detail: str, field: str = "body") -> None:
    body = json.dumps({"detail": detail, "field": field}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
