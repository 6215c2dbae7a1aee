"""Getting into pods: ``GET /v1/pods/{ref}/access`` (the ssh command, proxy URLs) and the
exec WebSocket ``/v1/pods/{ref}/exec`` (protocol in gpucloud.access.exec)."""

from __future__ import annotations

from fastapi import APIRouter, Request, WebSocket
from starlette.concurrency import run_in_threadpool

from gpucloud.access import exec as pod_exec
from gpucloud.api.deps import Caller, Ctx
from gpucloud.api.errors import status_of
from gpucloud.core.access import PodAccessOut
from gpucloud.core.errors import GpucloudError, Unauthorized
from gpucloud.services import access, projects
from gpucloud.services.context import ServiceContext
from gpucloud.services.projects import Principal

router = APIRouter(prefix="/v1/pods", tags=["access"])


@router.get("/{ref}/access")
def pod_access(ref: str, ctx: Ctx, caller: Caller, request: Request) -> PodAccessOut:
    points = access.AccessPoints(host=request.url.hostname or "127.0.0.1",
                                 api_port=request.url.port,
                                 ssh_port=getattr(request.app.state, "ssh_port", None))
    return access.pod_access(ctx, caller.project_id, ref, points)


def _offered_token(websocket: WebSocket) -> str | None:
    """The API key: ``Authorization: Bearer`` or a ``bearer.KEY`` subprotocol."""
    scheme, _, value = websocket.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    for offered in websocket.scope.get("subprotocols", []):
        if offered.startswith(pod_exec.TOKEN_SUBPROTOCOL_PREFIX):
            return str(offered).removeprefix(pod_exec.TOKEN_SUBPROTOCOL_PREFIX)
    return None


async def _principal(ctx: ServiceContext, websocket: WebSocket) -> Principal:
    key = _offered_token(websocket)
    if not key:
        raise Unauthorized("missing API key (Authorization: Bearer, or a bearer.KEY "
                           "subprotocol)")
    cached = projects.cached_principal(ctx, key)
    if cached is not None:
        return cached
    return await run_in_threadpool(projects.authenticate, ctx, key)


@router.websocket("/{ref}/exec")
async def exec_ws(websocket: WebSocket, ref: str) -> None:
    ctx: ServiceContext = websocket.app.state.ctx
    offered = websocket.scope.get("subprotocols", [])
    await websocket.accept(
        subprotocol=pod_exec.SUBPROTOCOL if pod_exec.SUBPROTOCOL in offered else None)
    try:
        principal = await _principal(ctx, websocket)
        await pod_exec.serve(websocket, ctx, principal, ref)
    except GpucloudError as error:
        code = status_of(error)
        await websocket.send_bytes(pod_exec.error_frame(error, code))
        await websocket.close(4000 + code)
