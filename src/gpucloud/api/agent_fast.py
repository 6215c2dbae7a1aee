"""The agent's two hot routes, renewal and long poll, without the framework's request cycle.

At 10,000 agents a replica answers ~500 renewals and ~400 polls a second, and a third of
its CPU went to the request cycle around them: FastAPI's routing through every included
router, its dependency solving (the context, the Bearer scheme, the node credential),
the body read into a dict and validated, the answer dumped to a dict, validated again
against the response model and encoded. ``AgentFastPath`` serves a well-formed
``POST /v1/agent/lease`` and ``GET /v1/agent/assignments`` itself: the body parsed by one
pydantic ``validate_json`` into the route's own model, the answer encoded by one
``model_dump_json``, and the same work as the FastAPI route (``routers.agent.renew`` and
``poll``: the same credential, failure buckets, guard and capacity).

Everything else goes to the app as before, and so does an agent request this path does
not recognise as well-formed (no Bearer token, another content type, a body or query
that does not parse into the route's model): the FastAPI route answers it, with its
documented errors, so what a client can see does not depend on which path served it. The
routes stay in the OpenAPI document (schemathesis fuzzes them, and its requests mostly
reach this path). It sits innermost among the middlewares, so the body limit and its
JSON checks, the metrics (the route's template, set here as the router would) and the
activity stamp still see these requests; an error raised here is answered by the app's
own exception handlers (api/errors.py), as inside the router.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from gpucloud.api.deps import NodeCredential
from gpucloud.api.limits import read_body, replay_body
from gpucloud.api.routers import agent
from gpucloud.core.models import MAX_POLL_WAIT_SECONDS, LeaseRequest
from gpucloud.services import auth_guard, metrics, ratelimit
from gpucloud.services.context import ServiceContext

LEASE = "/v1/agent/lease"
ASSIGNMENTS = "/v1/agent/assignments"
#: Query values taken here; anything else (``inf``, ``1e3``, a huge revision) goes to the
#: route, whose validation answers it.
_WAIT = re.compile(r"\d{1,2}(\.\d{1,6})?")
_REVISION = re.compile(r"-?\d{1,18}")
#: The route's bound on ``wait``.
MAX_WAIT = MAX_POLL_WAIT_SECONDS


class Fallback(Exception):
    """Not well-formed for this path: the FastAPI route answers it."""


Handler = Callable[[ServiceContext, Scope, bytes, NodeCredential], Awaitable[BaseModel]]


class AgentFastPath:
    """Serves the agent's renewals and long polls (see the module); the rest to ``app``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._handlers: dict[tuple[str, str], Handler] = {
            ("POST", LEASE): _lease, ("GET", ASSIGNMENTS): _assignments}
        #: what the router would set as ``scope["route"]`` (the metrics' template)
        self._routes: dict[str, BaseRoute] = {
            path: route for route in agent.router.routes
            if (path := getattr(route, "path", "")) in (LEASE, ASSIGNMENTS)}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = (self._handlers.get((scope["method"], scope["path"]))
                   if scope["type"] == "http" else None)
        ctx: ServiceContext | None = getattr(scope["app"].state, "ctx", None) \
            if handler is not None else None
        if handler is None or ctx is None:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive) if scope["method"] == "POST" else b""
        try:
            credential = _credential(ctx, scope)
            scope["route"] = self._routes[scope["path"]]
            answer = await handler(ctx, scope, body, credential)
        except Fallback:
            scope.pop("route", None)
            metrics.AGENT_FAST_PATH.labels(scope["path"], "route").inc()
            await self.app(scope, replay_body(body, receive), send)
            return
        except Exception as error:  # noqa: BLE001 - the app's handlers answer it (or re-raise)
            metrics.AGENT_FAST_PATH.labels(scope["path"], "fast").inc()
            await _handled(scope, receive, send, error)
            return
        metrics.AGENT_FAST_PATH.labels(scope["path"], "fast").inc()
        await _send_json(send, 200, answer.model_dump_json().encode())


def _credential(ctx: ServiceContext, scope: Scope) -> NodeCredential:
    """The node token of a ``Bearer`` header and its failure buckets, checked as
    ``deps.get_node_credential`` does; no such header: ``Fallback``."""
    token = _bearer(scope)
    if token is None:
        raise Fallback
    client = scope.get("client")
    keys = ratelimit.api_keys(client[0] if client else None, token)
    auth_guard.check(ctx, keys)
    return NodeCredential(token, keys)


def _bearer(scope: Scope) -> str | None:
    """The credentials of the first ``Authorization`` header if its scheme is Bearer
    (FastAPI's ``HTTPBearer``, then ``deps._bearer``'s strip)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, param = value.decode("latin-1").partition(" ")
            token = param.strip()
            return token if scheme.lower() == "bearer" and token else None
    return None


async def _lease(ctx: ServiceContext, scope: Scope, body: bytes,
                 credential: NodeCredential) -> BaseModel:
    if not _is_json(scope):
        raise Fallback
    try:
        request = LeaseRequest.model_validate_json(body)
    except ValidationError:
        raise Fallback from None
    return await agent.renew(ctx, request, credential)


async def _assignments(ctx: ServiceContext, scope: Scope, _: bytes,
                       credential: NodeCredential) -> BaseModel:
    wait, revision = _poll_query(scope["query_string"])
    return await agent.poll(ctx, credential, wait, revision)


def _poll_query(raw: bytes) -> tuple[float, int | None]:
    """``wait`` and ``revision`` of a plain query (each at most once, in the forms the
    agent sends); anything else is the route's to validate."""
    try:
        pairs = parse_qsl(raw.decode("ascii"), keep_blank_values=True,
                          strict_parsing=bool(raw))
    except (UnicodeDecodeError, ValueError):
        raise Fallback from None
    values = dict(pairs)
    if len(values) != len(pairs) or not set(values) <= {"wait", "revision"}:
        raise Fallback
    wait_text, revision_text = values.get("wait", "0"), values.get("revision")
    if not _WAIT.fullmatch(wait_text) or float(wait_text) > MAX_WAIT or (
            revision_text is not None and not _REVISION.fullmatch(revision_text)):
        raise Fallback
    return float(wait_text), None if revision_text is None else int(revision_text)


def _is_json(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return bool(value.split(b";", 1)[0].strip().lower() == b"application/json")
    return False


async def _handled(scope: Scope, receive: Receive, send: Send, error: Exception) -> None:
    """Answer ``error`` with the app's handler for it (api/errors.py), found by its
    class's MRO as Starlette's ExceptionMiddleware does; none: it propagates (a 500)."""
    handlers: dict[Any, Any] = scope["app"].exception_handlers
    handler = next((handlers[kind] for kind in type(error).__mro__ if kind in handlers), None)
    if handler is None:
        raise error
    response = await handler(Request(scope, receive), error)
    await response(scope, receive, send)


async def _send_json(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", str(len(body)).encode()),
                            (b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})
