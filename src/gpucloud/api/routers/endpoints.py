"""/v1/endpoints: serverless endpoints of the caller's project (``gpucloud endpoint``)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from gpucloud.api.deps import Caller, Ctx
from gpucloud.core.serverless import EndpointCreateRequest, EndpointOut, EndpointUpdateRequest
from gpucloud.services import endpoints

router = APIRouter(prefix="/v1/endpoints", tags=["endpoints"])


@router.post("", status_code=201)
def create_endpoint(body: EndpointCreateRequest, ctx: Ctx, caller: Caller) -> EndpointOut:
    return endpoints.create_endpoint(ctx, caller, body)


@router.get("")
def list_endpoints(ctx: Ctx, caller: Caller) -> list[EndpointOut]:
    return endpoints.list_endpoints(ctx, caller)


@router.get("/{ref}")
def get_endpoint(ref: str, ctx: Ctx, caller: Caller) -> EndpointOut:
    return endpoints.get_endpoint(ctx, caller, ref)


@router.patch("/{ref}")
def update_endpoint(ref: str, body: EndpointUpdateRequest, ctx: Ctx,
                    caller: Caller) -> EndpointOut:
    return endpoints.update_endpoint(ctx, caller, ref, body)


@router.delete("/{ref}", status_code=204)
def delete_endpoint(ref: str, ctx: Ctx, caller: Caller) -> Response:
    endpoints.delete_endpoint(ctx, caller, ref)
    return Response(status_code=204)
