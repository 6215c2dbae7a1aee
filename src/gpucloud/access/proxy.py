"""The HTTP proxy to pods' ``N/http`` ports, an ASGI layer in front of the API.

Two forms reach port N of a pod: the Host ``{pod-id}-{N}.{domain}`` (any server port; the
primary form, since apps need no base path) and the path ``/proxy/{pod-id}/{N}/…`` (the
prefix is stripped and sent as ``X-Forwarded-Prefix``). Everything else goes to the API.

Who may pass: a caller with the project's API key (``Authorization: Bearer``), or a
browser holding the pod's proxy token: ``?gpucloud_token=T`` is answered with a redirect
that sets it as an HttpOnly cookie and drops the parameter. Another project's pod, an
unknown pod and an undeclared port are all 404; a pod that is not running is 503; a pod
server that fails is 502 — each a one-line text body, never a trace.

The Host header goes upstream unchanged (and as ``X-Forwarded-Host``): apps build their
absolute URLs from it, and Jupyter compares a WebSocket's Origin against it.
"""

from __future__ import annotations

import asyncio
import hmac
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import unquote

from gpucloud.access import upstream
from gpucloud.access.proxy_http import (
    STREAM_ERRORS,
    Headers,
    Opener,
    ProxyRequest,
    Reader,
    Receive,
    Send,
    UpstreamFailed,
    UpstreamIdle,
    UpstreamPool,
    Writer,
    drop_hop_by_hop,
    forward,
)
from gpucloud.access.proxy_ws import Rejected, WsRequest, handshake, relay
from gpucloud.core.errors import GpucloudError, Unauthorized
from gpucloud.core.phases import PodPhase
from gpucloud.services import projects
from gpucloud.services.access import unreachable_reason
from gpucloud.services.context import ServiceContext
from gpucloud.services.proxy import ProxyPod, cached_proxy_pod, proxy_pod

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
#: ``(ctx, pod_id, port) -> stream``; tests put another on ``app.state.proxy_opener``.
ContextOpener = Callable[[ServiceContext, str, int], Awaitable[tuple[Reader, Writer]]]

TOKEN_PARAM = b"gpucloud_token"
COOKIE_PREFIX = "gpucloud_proxy_"
_PATH = re.compile(rb"^/proxy/([0-9a-f]{32})/(\d{1,5})(/.*)?$")
_HOST = r"^([0-9a-f]{{32}})-(\d{{1,5}})\.{domain}(?::\d+)?$"
#: Request headers the proxy sets itself (a client's own would be trusted upstream).
_OWN_HEADERS = {b"host", b"expect", b"x-forwarded-proto", b"x-forwarded-host",
                b"x-forwarded-prefix", b"x-forwarded-for"}
_WS_HANDSHAKE = {b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-protocol",
                 b"sec-websocket-extensions"}


@dataclass(frozen=True)
class Route:
    pod_id: str
    port: int
    #: The path for the pod's server (the path form's prefix stripped), without query.
    path: bytes
    #: ``/proxy/{pod-id}/{port}`` for the path form, else None.
    prefix: str | None


class Refusal(Exception):
    """An answer instead of a forward: status, one line, optional headers."""

    def __init__(self, status: int, text: str, headers: Headers | None = None) -> None:
        super().__init__(text)
        self.status, self.text, self.headers = status, text, headers or []


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value)
    return None


def route_of(scope: Scope, domain: str) -> Route | None:
    """The pod port a request is for, or None when it is for the API."""
    host = (_header(scope, b"host") or b"").decode("latin-1").lower()
    match = re.match(_HOST.format(domain=re.escape(domain.lower())), host)
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
    if match:
        return Route(match.group(1), int(match.group(2)), raw_path or b"/", None)
    found = _PATH.match(raw_path)
    if not found:
        return None
    pod_id, port = found.group(1).decode(), int(found.group(2))
    return Route(pod_id, port, found.group(3) or b"", f"/proxy/{pod_id}/{port}")


def split_token(query: bytes) -> tuple[str | None, bytes]:
    """The ``gpucloud_token`` parameter and the query without it."""
    token, kept = None, []
    for part in query.split(b"&") if query else []:
        name, _, value = part.partition(b"=")
        if name == TOKEN_PARAM:
            token = unquote(value.decode("latin-1"))
        else:
            kept.append(part)
    return token, b"&".join(kept)


def cookies(scope: Scope) -> list[tuple[str, str]]:
    raw = (_header(scope, b"cookie") or b"").decode("latin-1")
    pairs = (part.strip().partition("=") for part in raw.split(";"))
    return [(name, value) for name, _, value in pairs if name]


def without_own_cookies(value: bytes) -> bytes:
    """The Cookie header minus the proxy's cookies (they are no business of the pod)."""
    parts = [part.strip() for part in value.decode("latin-1").split(";")]
    return "; ".join(p for p in parts if p and not p.startswith(COOKIE_PREFIX)).encode(
        "latin-1")


def _bearer(scope: Scope) -> str | None:
    value = (_header(scope, b"authorization") or b"").decode("latin-1")
    scheme, _, key = value.partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


def _matches(token: str | None, pod: ProxyPod | None) -> bool:
    return bool(token and pod and pod.proxy_token
                and hmac.compare_digest(token.encode(), pod.proxy_token.encode()))


class ProxyMiddleware:
    """Serves proxy routes; passes every other request (and lifespan) to ``app``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._pools: dict[asyncio.AbstractEventLoop, UpstreamPool] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = None
        ctx: ServiceContext | None = None
        if scope["type"] in ("http", "websocket"):
            # No context before the lifespan ran (an app served without one): no proxy.
            ctx = getattr(scope["app"].state, "ctx", None)
        if ctx is not None:
            route = route_of(scope, ctx.settings.proxy_domain)
        if route is None or ctx is None:
            await self.app(scope, receive, send)
            return
        try:
            await self._serve(ctx, route, scope, receive, send)
        except Refusal as refusal:
            await _refuse(scope, send, refusal)

    def _pool(self, scope: Scope, ctx: ServiceContext) -> UpstreamPool:
        loop = asyncio.get_running_loop()
        if loop not in self._pools:
            opener: ContextOpener = getattr(scope["app"].state, "proxy_opener",
                                            upstream.open_pod_stream)
            self._pools = {loop: UpstreamPool(partial(opener, ctx))}
        return self._pools[loop]

    async def _serve(self, ctx: ServiceContext, route: Route, scope: Scope,
                     receive: Receive, send: Send) -> None:
        pod, used_key = await _authorize(ctx, route, scope)
        if route.port not in pod.http_ports:
            raise Refusal(404, f"pod {pod.name} has no HTTP port {route.port} (declare it "
                          f"with --port {route.port}/http)")
        if pod.phase is not PodPhase.RUNNING:
            raise Refusal(503, unreachable_reason(pod.name, pod.phase))
        pool = self._pool(scope, ctx)
        idle = ctx.settings.proxy_idle_timeout_seconds
        try:
            if scope["type"] == "http":
                await forward(pool, (pod.pod_id, route.port),
                              http_request(scope, route, used_key), receive, send, idle)
            else:
                await _websocket(pool.opener, route, pod, scope, receive, send,
                                 ws_request(scope, route, used_key), idle)
        except UpstreamFailed as error:
            raise Refusal(502, str(error)) from None
        except UpstreamIdle as error:
            raise Refusal(504, f"pod {pod.name} port {route.port}: {error}") from None
        except GpucloudError as error:
            raise Refusal(503, error.message) from None


async def _authorize(ctx: ServiceContext, route: Route, scope: Scope) -> tuple[ProxyPod, bool]:
    """The pod, if the caller may reach it, and whether an API key was the credential
    (then it is not passed on to the pod). Raises Refusal otherwise; a redirect for a
    browser that brought ``?gpucloud_token=`` in an HTTP request."""
    pod = cached_proxy_pod(ctx, route.pod_id) or await asyncio.to_thread(
        proxy_pod, ctx, route.pod_id)
    missing = Refusal(404, f"pod {route.pod_id} not found")
    token, query = split_token(scope.get("query_string", b""))
    if token is not None:
        if not _matches(token, pod):
            raise missing
        assert pod is not None
        if scope["type"] == "http":
            raise _cookie_redirect(scope, route, pod, query)
        return pod, False
    if any(name == COOKIE_PREFIX + route.pod_id and _matches(value, pod)
           for name, value in cookies(scope)):
        assert pod is not None
        return pod, False
    key = _bearer(scope)
    if key is None:
        raise Refusal(401, "send 'Authorization: Bearer KEY', or open the pod's URL once "
                      "with ?gpucloud_token=TOKEN (from GET /v1/pods/POD/access)",
                      [(b"www-authenticate", b"Bearer")])
    principal = projects.cached_principal(ctx, key)
    if principal is None:
        try:
            principal = await asyncio.to_thread(projects.authenticate, ctx, key)
        except Unauthorized as error:
            raise Refusal(401, error.message) from None
    if pod is None or pod.project_id != principal.project_id:
        raise missing
    return pod, True


def _cookie_redirect(scope: Scope, route: Route, pod: ProxyPod, query: bytes) -> Refusal:
    """307 to the same URL without the token, setting the pod's cookie."""
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
    location = raw_path + (b"?" + query if query else b"")
    secure = "; Secure" if scope.get("scheme") == "https" else ""
    path = f"/proxy/{pod.pod_id}/" if route.prefix else "/"
    cookie = (f"{COOKIE_PREFIX}{pod.pod_id}={pod.proxy_token}; Path={path}; HttpOnly; "
              f"SameSite=Lax{secure}")
    return Refusal(307, "redirecting", [(b"location", location),
                                        (b"set-cookie", cookie.encode())])


def forwarded_headers(scope: Scope, route: Route, strip_auth: bool) -> Headers:
    """The client's end-to-end headers, minus the proxy's credentials, plus X-Forwarded-*."""
    kept: Headers = []
    chain = []
    for name, value in drop_hop_by_hop(scope["headers"]):
        if name == b"x-forwarded-for":
            chain.append(value)
        if name in _OWN_HEADERS or (name == b"authorization" and strip_auth):
            continue
        if name == b"cookie":
            value = without_own_cookies(value)
            if not value:
                continue
        kept.append((name, value))
    client = scope.get("client")
    if client:
        chain.append(str(client[0]).encode())
    proto = b"https" if scope.get("scheme") in ("https", "wss") else b"http"
    kept += [(b"x-forwarded-proto", proto), (b"x-forwarded-host", _host(scope, route))]
    if chain:
        kept.append((b"x-forwarded-for", b", ".join(chain)))
    if route.prefix:
        kept.append((b"x-forwarded-prefix", route.prefix.encode()))
    return kept


def _host(scope: Scope, route: Route) -> bytes:
    return _header(scope, b"host") or f"localhost:{route.port}".encode()


def _target(scope: Scope, route: Route) -> bytes:
    _, query = split_token(scope.get("query_string", b""))
    return (route.path or b"/") + (b"?" + query if query else b"")


def http_request(scope: Scope, route: Route, strip_auth: bool) -> ProxyRequest:
    if route.prefix and not route.path:
        # ``/proxy/ID/PORT`` → ``/proxy/ID/PORT/``: relative links then resolve inside.
        query = scope.get("query_string", b"")
        raise Refusal(307, "redirecting", [(b"location", route.prefix.encode() + b"/" + (
            b"?" + query if query else b""))])
    headers = [(b"host", _host(scope, route)), *forwarded_headers(scope, route, strip_auth)]
    chunked = (_header(scope, b"transfer-encoding") or b"").lower().endswith(b"chunked")
    has_length = _header(scope, b"content-length") not in (None, b"0")
    if chunked and _header(scope, b"content-length") is None:
        headers.append((b"transfer-encoding", b"chunked"))
    return ProxyRequest(method=scope["method"].encode(), target=_target(scope, route),
                        headers=headers, has_body=chunked or has_length)


def ws_request(scope: Scope, route: Route, strip_auth: bool) -> WsRequest:
    headers = [(n, v) for n, v in forwarded_headers(scope, route, strip_auth)
               if n not in _WS_HANDSHAKE]
    return WsRequest(host=_host(scope, route).decode("latin-1"),
                     target=_target(scope, route).decode("latin-1"), headers=headers,
                     subprotocols=list(scope.get("subprotocols", [])))


async def _websocket(opener: Opener, route: Route, pod: ProxyPod, scope: Scope,
                     receive: Receive, send: Send, request: WsRequest, idle: float) -> None:
    """Handshake with the pod's server, then accept the client and relay."""
    first = await receive()
    if first["type"] != "websocket.connect":
        return
    try:
        reader, writer = await opener(pod.pod_id, route.port)
    except STREAM_ERRORS as error:
        raise UpstreamFailed(f"cannot reach port {route.port} of pod {pod.name}: "
                             f"{str(error).strip() or type(error).__name__}") from None
    try:
        ws, answer = await handshake(reader, writer, request, idle)
    except STREAM_ERRORS as error:
        writer.close()
        raise UpstreamFailed(f"pod {pod.name} port {route.port}: WebSocket handshake "
                             f"failed: {error}") from None
    except TimeoutError:
        writer.close()
        raise UpstreamIdle(f"no WebSocket handshake in {idle:g} s") from None
    if isinstance(answer, Rejected):
        writer.close()
        await _deny(scope, send, answer.status, answer.body, answer.headers)
        return
    await send({"type": "websocket.accept", "subprotocol": answer.subprotocol})
    await relay(ws, reader, writer, receive, send, idle)


async def _refuse(scope: Scope, send: Send, refusal: Refusal) -> None:
    body = (refusal.text + "\n").encode()
    headers = [(b"content-type", b"text/plain; charset=utf-8"), *refusal.headers]
    await _deny(scope, send, refusal.status, body, headers)


async def _deny(scope: Scope, send: Send, status: int, body: bytes, headers: Headers) -> None:
    """An HTTP answer; for a WebSocket not yet accepted, the denial response where the
    server supports it (else a close, which servers send as 403)."""
    if scope["type"] == "http":
        kind = "http.response"
    elif "websocket.http.response" in scope.get("extensions", {}):
        kind = "websocket.http.response"
    else:
        await send({"type": "websocket.close", "code": 1008})
        return
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": f"{kind}.start", "status": status, "headers": headers})
    await send({"type": f"{kind}.body", "body": body})
