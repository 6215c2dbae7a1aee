"""Request dependencies: the service context and the authenticated caller."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from gpucloud.services import auth_guard, nodes, projects, ratelimit
from gpucloud.services.context import ServiceContext
from gpucloud.services.projects import Principal


async def get_ctx(request: Request) -> ServiceContext:
    ctx: ServiceContext = request.app.state.ctx
    return ctx


#: The two credentials, as OpenAPI security schemes: a project's API key (``gpc_…``) and
#: a node's token (``gpn_…``, from ``POST /v1/agent/register``). ``auto_error=False``: a
#: missing or malformed header reaches the services, which answer 401 in the one error shape.
API_KEY = HTTPBearer(scheme_name="ApiKey", auto_error=False,
                     description="A project's API key: `Authorization: Bearer gpc_…`")
NODE_TOKEN = HTTPBearer(scheme_name="NodeToken", auto_error=False,
                        description="A node's token from `POST /v1/agent/register`: "
                        "`Authorization: Bearer gpn_…`")
Credentials = HTTPAuthorizationCredentials | None


def _bearer(credentials: Credentials) -> str | None:
    return credentials.credentials.strip() if credentials else None


# The dependencies are async so that FastAPI does not hand each one to a worker thread;
# the only blocking work, a database lookup on a cache miss, is sent to one explicitly.


def _limit_keys(request: Request, credential: str | None) -> ratelimit.Limits:
    """The failure buckets of this request: its TCP peer and the credential's prefix."""
    return ratelimit.api_keys(request.client.host if request.client else None, credential)


async def get_principal(
    request: Request,
    ctx: Annotated[ServiceContext, Depends(get_ctx)],
    credentials: Annotated[Credentials, Depends(API_KEY)],
) -> Principal:
    return await authenticate_key(request, ctx, _bearer(credentials))


async def authenticate_key(request: Request, ctx: ServiceContext, key: str | None
                           ) -> Principal:
    """The caller of a project's API key, however it came (a Bearer header here; RunPod's
    bare header or ``?api_key=``; the console's session): the failure guard of this
    request's buckets, then the principal cache, then the database on a worker thread."""
    keys = _limit_keys(request, key)
    auth_guard.check(ctx, keys)  # even a cached key: a blocked guesser learns nothing
    cached = projects.cached_principal(ctx, key)
    if cached is not None:
        auth_guard.succeeded(ctx, keys)
        return cached
    return await run_in_threadpool(auth_guard.authenticated, ctx, keys,
                                   partial(projects.authenticate, ctx, key))


@dataclass(frozen=True)
class NodeCredential:
    """A node token not yet checked, and its failure buckets (already not blocked)."""

    token: str | None
    limit_keys: ratelimit.Limits

    def authenticate(self, ctx: ServiceContext) -> str:
        """The node's id (blocking: a query on a cache miss); a failure counts."""
        return auth_guard.authenticated(ctx, self.limit_keys,
                                        partial(nodes.authenticate_node, ctx, self.token))

    def succeeded(self, ctx: ServiceContext) -> None:
        """The token passed elsewhere (the cache, the renewal's own statement)."""
        auth_guard.succeeded(ctx, self.limit_keys)


async def get_node_credential(
    request: Request,
    ctx: Annotated[ServiceContext, Depends(get_ctx)],
    credentials: Annotated[Credentials, Depends(NODE_TOKEN)],
) -> NodeCredential:
    """For a route that authenticates the token itself, as part of its own statement
    (the lease renewal's hot path)."""
    token = _bearer(credentials)
    keys = _limit_keys(request, token)
    auth_guard.check(ctx, keys)
    return NodeCredential(token, keys)


async def get_node_id(
    ctx: Annotated[ServiceContext, Depends(get_ctx)],
    credential: Annotated[NodeCredential, Depends(get_node_credential)],
) -> str:
    cached = nodes.cached_node(ctx, credential.token)
    if cached is not None:
        credential.succeeded(ctx)
        return cached
    return await run_in_threadpool(credential.authenticate, ctx)


async def get_admin(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    principal.require_admin()
    return principal


Ctx = Annotated[ServiceContext, Depends(get_ctx)]
Caller = Annotated[Principal, Depends(get_principal)]
Admin = Annotated[Principal, Depends(get_admin)]
NodeId = Annotated[str, Depends(get_node_id)]
NodeToken = Annotated[NodeCredential, Depends(get_node_credential)]
