"""/v1/registry-auths: registry credentials of the caller's project (never shown back)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from gpucloud.api.deps import Caller, Ctx
from gpucloud.core.spec import RegistryAuthAddRequest, RegistryAuthOut
from gpucloud.services import registry_auths

router = APIRouter(prefix="/v1/registry-auths", tags=["registry-auths"])


@router.post("", status_code=201)
def add_registry_auth(body: RegistryAuthAddRequest, ctx: Ctx,
                      caller: Caller) -> RegistryAuthOut:
    return registry_auths.add_registry_auth(ctx, caller, body)


@router.get("")
def list_registry_auths(ctx: Ctx, caller: Caller) -> list[RegistryAuthOut]:
    return registry_auths.list_registry_auths(ctx, caller)


@router.delete("/{ref}", status_code=204)
def remove_registry_auth(ref: str, ctx: Ctx, caller: Caller) -> Response:
    registry_auths.remove_registry_auth(ctx, caller, ref)
    return Response(status_code=204)
