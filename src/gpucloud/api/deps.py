"""Request dependencies: the service context and the authenticated caller."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request
from starlette.concurrency import run_in_threadpool

from gpucloud.services import nodes, projects
from gpucloud.services.context import ServiceContext
from gpucloud.services.projects import Principal


async def get_ctx(request: Request) -> ServiceContext:
    ctx: ServiceContext = request.app.state.ctx
    return ctx


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


# The dependencies are async so that FastAPI does not hand each one to a worker thread;
# the only blocking work, a database lookup on a cache miss, is sent to one explicitly.


async def get_principal(
    ctx: Annotated[ServiceContext, Depends(get_ctx)],
    authorization: Annotated[str | None, Header()] = None,
) -> Principal:
    key = _bearer(authorization)
    cached = projects.cached_principal(ctx, key)
    if cached is not None:
        return cached
    return await run_in_threadpool(projects.authenticate, ctx, key)


async def get_node_id(
    ctx: Annotated[ServiceContext, Depends(get_ctx)],
    authorization: Annotated[str | None, Header()] = None,
) -> str:
    return await run_in_threadpool(nodes.authenticate_node, ctx, _bearer(authorization))


async def get_admin(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    principal.require_admin()
    return principal


Ctx = Annotated[ServiceContext, Depends(get_ctx)]
Caller = Annotated[Principal, Depends(get_principal)]
Admin = Annotated[Principal, Depends(get_admin)]
NodeId = Annotated[str, Depends(get_node_id)]
