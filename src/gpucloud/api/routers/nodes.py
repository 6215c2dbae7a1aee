"""/v1/nodes: the fleet, as users and admins see it."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gpucloud.api.deps import Admin, Caller, Ctx
from gpucloud.core.models import (
    JoinTokenInfoOut,
    JoinTokenOut,
    JoinTokenRequest,
    NodeGpuActionRequest,
    NodeMigRequest,
    NodeOut,
)
from gpucloud.core.spot import NodeDrainRequest
from gpucloud.services import drain, join_tokens, nodes

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])


@router.post("/join-tokens", status_code=201)
def create_join_token(ctx: Ctx, caller: Admin,
                      body: JoinTokenRequest | None = None) -> JoinTokenOut:
    """A new join token (shown once); ``uses`` limits its registrations, ``ttl_seconds``
    its life."""
    return nodes.create_join_token(ctx, caller, body)


@router.get("/join-tokens")
def list_join_tokens(ctx: Ctx, caller: Admin) -> list[JoinTokenInfoOut]:
    return join_tokens.list_tokens(ctx, caller)


@router.post("/join-tokens/{ref}/revoke")
def revoke_join_token(ref: str, ctx: Ctx, caller: Admin) -> JoinTokenInfoOut:
    """Refuse the token from now on (by id or printed prefix); registered nodes stay."""
    return join_tokens.revoke(ctx, caller, ref)


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


@router.post("/{ref}/gpu-actions")
def gpu_action(ref: str, body: NodeGpuActionRequest, ctx: Ctx, caller: Admin) -> NodeOut:
    """Reset a GPU and run a diag, or run a diag (one GPU or all), through the node's
    agent; each GPU's ``maintenance`` shows the outcome once the agent reports it (a GPU
    that passes is back in service). A reset needs an idle GPU: 409 while pods hold it.
    ``mig-on`` / ``mig-off`` switch the GPU's MIG mode at drain time: the GPU leaves
    scheduling at once, the agent switches once no pod holds it (409 if pods do and
    ``wait_seconds`` is 0; failed if they still do after it), and its ``mig_mode`` follows."""
    return nodes.request_gpu_action(ctx, caller, ref, body)


@router.post("/{ref}/mig")
def set_mig_policy(ref: str, body: NodeMigRequest, ctx: Ctx, caller: Admin,
                   request: Request) -> NodeOut:
    """The node's MIG policy: ``dynamic`` (instances made as pods are placed), ``fixed``
    (only the instances it has), ``off`` (no MIG pods)."""
    node = nodes.set_mig_policy(ctx, caller, ref, body.mode)
    runner = getattr(request.app.state, "controllers", None)
    if runner is not None:
        runner.wake()
    return node


@router.post("/{ref}/drain")
def drain_node(ref: str, body: NodeDrainRequest, ctx: Ctx, caller: Admin,
               request: Request) -> NodeOut:
    node = drain.drain_node(ctx, caller, ref, body)
    _wake(request)
    return node


@router.post("/{ref}/undrain")
def undrain_node(ref: str, ctx: Ctx, caller: Admin, request: Request) -> NodeOut:
    node = drain.undrain_node(ctx, caller, ref)
    _wake(request)
    return node


def _wake(request: Request) -> None:
    """Run the controllers now: pods to place elsewhere, or a node open again."""
    runner = getattr(request.app.state, "controllers", None)
    if runner is not None:
        runner.wake()
