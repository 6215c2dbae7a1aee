"""/v1/nodes: the fleet, as users and admins see it."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gpucloud.api.deps import Admin, Caller, Ctx
from gpucloud.core.models import JoinTokenOut, NodeOut
from gpucloud.services import nodes

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])


@router.post("/join-tokens", status_code=201)
def create_join_token(ctx: Ctx, caller: Admin) -> JoinTokenOut:
    return nodes.create_join_token(ctx, caller)


@router.get("")
def list_nodes(ctx: Ctx, _caller: Caller) -> list[NodeOut]:
    return nodes.list_nodes(ctx)


@router.get("/{ref}")
def get_node(ref: str, ctx: Ctx, _caller: Caller) -> NodeOut:
    return nodes.get_node(ctx, ref)


@router.post("/{ref}/cordon")
def cordon(ref: str, ctx: Ctx, caller: Admin) -> NodeOut:
    return nodes.set_cordoned(ctx, caller, ref, True)


@router.post("/{ref}/uncordon")
def uncordon(ref: str, ctx: Ctx, caller: Admin, request: Request) -> NodeOut:
    node = nodes.set_cordoned(ctx, caller, ref, False)
    runner = getattr(request.app.state, "controllers", None)
    if runner is not None:
        runner.wake()
    return node
