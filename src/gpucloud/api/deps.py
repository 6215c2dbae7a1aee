"""Request dependencies: the service context and the authenticated caller."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from gpucloud.services import nodes, projects
from gpucloud.services.context import ServiceContext
from gpucloud.services.projects import Principal


def get_ctx(request: Request) -> ServiceContext:
    ctx: ServiceContext = request.app.state.ctx
    return ctx


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def get_principal(
    ctx: Annotated[ServiceContext, Depends(get_ctx)],
    authorization: Annotated[str | None, Header()] = None,
) -> Principal:
    return projects.authenticate(ctx, _bearer(authorization))


def get_node_id(
    ctx: Annotated[ServiceContext, Depends(get_ctx)],
    authorization: Annotated[str | None, Header()] = None,
) -> str:
    return nodes.authenticate_node(ctx, _bearer(authorization))


def get_admin(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    principal.require_admin()
    return principal


Ctx = Annotated[ServiceContext, Depends(get_ctx)]
Caller = Annotated[Principal, Depends(get_principal)]
Admin = Annotated[Principal, Depends(get_admin)]
NodeId = Annotated[str, Depends(get_node_id)]
