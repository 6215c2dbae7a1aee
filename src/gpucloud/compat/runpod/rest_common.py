"""What RunPod's REST v1 and v2 routes share: the API key in any of the three places
RunPod clients put it, errors rendered in each version's own shape, and a pod's price
and GPU model for its rendering.

The key is a gpucloud project key, checked by the same guard (failure rate limits) and
cache as ``api.deps.get_principal``. Errors: a route class wraps each handler so that
gpucloud's exceptions, FastAPI's validation errors and Starlette's HTTP errors come back
as RunPod's body (v2: RFC 9457 ``{title, status, detail, errors}``; v1: ``{error,
status}``) with gpucloud's status codes (422 naming the field, 401, 403, 404, 409, 429).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from http import HTTPStatus
from typing import Annotated, Any

from fastapi import Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import APIKeyHeader, APIKeyQuery
from sqlalchemy import select
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpucloud.api.deps import Ctx, authenticate_key
from gpucloud.api.errors import describe_validation, status_of
from gpucloud.compat.runpod import mapping
from gpucloud.core.errors import GpucloudError, InvalidInput
from gpucloud.core.models import PodOut
from gpucloud.db.models import NodeModel
from gpucloud.services.context import ServiceContext
from gpucloud.services.prices import PriceBook, load_book
from gpucloud.services.projects import Principal
from gpucloud.services.ratelimit import RateLimited

#: ``Authorization: Bearer KEY`` or a bare ``Authorization: KEY`` (RunPod's raw-HTTP docs).
RUNPOD_KEY_HEADER = APIKeyHeader(
    name="Authorization", scheme_name="RunPodApiKey", auto_error=False,
    description="A gpucloud project key: `Authorization: Bearer KEY` or `Authorization: KEY`")
#: ``?api_key=KEY`` (dstack's RunPod client).
RUNPOD_KEY_QUERY = APIKeyQuery(name="api_key", scheme_name="RunPodApiKeyQuery",
                               auto_error=False, description="A gpucloud project key")


def key_of(header: str | None, query: str | None) -> str | None:
    """The key from the header (with or without ``Bearer``), else from ``api_key``."""
    if header and header.strip():
        value = header.strip()
        scheme, _, rest = value.partition(" ")
        return (rest.strip() or None) if scheme.lower() == "bearer" else value
    return query.strip() if query and query.strip() else None


async def runpod_principal(
    request: Request, ctx: Ctx,
    header: Annotated[str | None, Depends(RUNPOD_KEY_HEADER)],
    query: Annotated[str | None, Depends(RUNPOD_KEY_QUERY)],
) -> Principal:
    return await authenticate_key(request, ctx, key_of(header, query))


RunpodCaller = Annotated[Principal, Depends(runpod_principal)]


@dataclass(frozen=True)
class Failure:
    """One error, before it is rendered in a version's shape."""

    status: int
    detail: str
    field: str | None = None
    retry_after: float | None = None


def _failure(error: Exception) -> Failure | None:
    if isinstance(error, RequestValidationError):
        field, message = describe_validation(error.errors())
        return Failure(422, message, field)
    if isinstance(error, InvalidInput):
        return Failure(422, error.message, error.field)
    if isinstance(error, RateLimited):
        return Failure(429, error.message, retry_after=error.retry_after_seconds)
    if isinstance(error, GpucloudError):
        return Failure(status_of(error), error.message)
    if isinstance(error, StarletteHTTPException) and error.status_code == 400:
        return Failure(422, "body: could not be parsed as JSON", "body")
    return None


class RunpodRoute(APIRoute):
    """A route whose errors come back in RunPod's shape (``render``, per version)."""

    @staticmethod
    def render(failure: Failure) -> JSONResponse:
        """The error body of the route's version (each subclass gives its own)."""
        raise NotImplementedError

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        original = super().get_route_handler()
        render = type(self).render

        async def handler(request: Request) -> Response:
            try:
                return await original(request)
            except (RequestValidationError, GpucloudError, StarletteHTTPException) as error:
                failure = _failure(error)
                if failure is None:
                    raise  # 413 and the like: the app's own handler answers
                response = render(failure)
                if failure.retry_after is not None:
                    response.headers["Retry-After"] = str(max(1, math.ceil(failure.retry_after)))
                if failure.status == 401:
                    response.headers["WWW-Authenticate"] = "Bearer"
                return response

        return handler


def title_of(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


@dataclass
class PodPricing:
    """What rendering a pod needs besides the pod, loaded once per request: the price
    book, the time, and the GPU model of every registered GPU (a pod's model is that of
    the GPUs it holds, else the one it asked for). GraphQL and both REST versions price
    and name a pod's GPUs through it."""

    book: PriceBook
    now: datetime
    models: dict[str, str]

    @classmethod
    def load(cls, ctx: ServiceContext) -> PodPricing:
        with ctx.db.read() as session:
            rows = session.scalars(select(NodeModel.gpus)).all()
            models = {str(g["uuid"]): mapping.gpu_model(str(g.get("model", "")) or "?")
                      for gpus in rows for g in gpus}
            return cls(load_book(session), ctx.clock.now(), models)

    def model(self, pod: PodOut) -> str | None:
        for uuid in pod.gpu_uuids:
            if uuid in self.models:
                return self.models[uuid]
        return mapping.gpu_model(pod.gpu_type) if pod.gpu_type else None

    def cost(self, pod: PodOut) -> Decimal:
        return mapping.hourly_price(self.book, self.model(pod), pod.gpus, pod.cpu, pod.spot,
                                    self.now)


def gpu_count(pod: PodOut) -> int:
    """Whole GPUs as RunPod counts them (a share of one GPU is one)."""
    return int(pod.gpus) if pod.gpus >= 1 else (1 if pod.gpus else 0)


def ssh_direct(pod: PodOut) -> tuple[str, int] | None:
    """The public address and port of the pod's 22/tcp, once published."""
    for port in pod.ports_runtime:
        if port.isIpPublic and port.privatePort == 22 and port.publicPort:
            return port.ip, port.publicPort
    return None


def wake(request: Request) -> None:
    """Wake the app's controllers (the scheduler) after a pod was created or started."""
    runner = getattr(request.app.state, "controllers", None)
    if runner is not None:
        runner.wake()


def gateway_endpoint(request: Request) -> tuple[str, int] | None:
    """The SSH gateway's address, when this server runs one."""
    ctx: ServiceContext = request.app.state.ctx
    port = getattr(request.app.state, "ssh_port", None)  # set by access.gateway
    return (ctx.settings.ssh_host, int(port)) if port else None
