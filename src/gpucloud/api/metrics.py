"""``GET /metrics`` (Prometheus text, unauthenticated as scrape targets are) and the ASGI
middleware that counts requests by route *template* (``/v1/pods/{pod_id}``, never the
concrete path, so the number of series stays bounded) and status code."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpucloud.services import metrics

router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False)
def prometheus(request: Request) -> Response:
    return Response(metrics.exposition(request.app.state.ctx),
                    media_type=metrics.CONTENT_TYPE)


class MetricsMiddleware:
    """Counts every HTTP request the routers see: route template, method, code, latency."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route, method = route_template(scope), str(scope.get("method", ""))
            metrics.REQUESTS.labels(route, method, str(status["code"])).inc()
            metrics.REQUEST_SECONDS.labels(route, method).observe(
                time.perf_counter() - started)


def route_template(scope: Scope) -> str:
    """The path template of the route that handled the request (``<unmatched>``: none)."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str):
        return path
    app = scope.get("app")
    for candidate in getattr(getattr(app, "router", None), "routes", ()):
        match, _ = candidate.matches(scope)
        if match == Match.FULL:
            return str(getattr(candidate, "path", metrics.UNMATCHED))
    return metrics.UNMATCHED
