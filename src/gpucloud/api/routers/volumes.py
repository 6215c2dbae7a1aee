"""/v1/volumes: the network volumes of the caller's project."""

from __future__ import annotations

from fastapi import APIRouter, Response

from gpucloud.api.deps import Caller, Ctx
from gpucloud.core.access import VolumeCreateRequest, VolumeOut
from gpucloud.services import volumes

router = APIRouter(prefix="/v1/volumes", tags=["volumes"])


@router.post("", status_code=201)
def create_volume(body: VolumeCreateRequest, ctx: Ctx, caller: Caller) -> VolumeOut:
    return volumes.create_volume(ctx, caller, body)


@router.get("")
def list_volumes(ctx: Ctx, caller: Caller) -> list[VolumeOut]:
    return volumes.list_volumes(ctx, caller)


@router.get("/{ref}")
def get_volume(ref: str, ctx: Ctx, caller: Caller) -> VolumeOut:
    return volumes.get_volume(ctx, caller, ref)


@router.delete("/{ref}", status_code=204)
def delete_volume(ref: str, ctx: Ctx, caller: Caller) -> Response:
    volumes.delete_volume(ctx, caller, ref)
    return Response(status_code=204)
