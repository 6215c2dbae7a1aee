"""/v1/templates: named container specs of the caller's project (``pod create --template``)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from gpucloud.api.deps import Caller, Ctx
from gpucloud.core.spec import TemplateCreateRequest, TemplateOut
from gpucloud.services import templates

router = APIRouter(prefix="/v1/templates", tags=["templates"])


@router.post("", status_code=201)
def create_template(body: TemplateCreateRequest, ctx: Ctx, caller: Caller) -> TemplateOut:
    return templates.create_template(ctx, caller, body)


@router.get("")
def list_templates(ctx: Ctx, caller: Caller) -> list[TemplateOut]:
    return templates.list_templates(ctx, caller)


@router.get("/{ref}")
def get_template(ref: str, ctx: Ctx, caller: Caller) -> TemplateOut:
    return templates.get_template(ctx, caller, ref)


@router.delete("/{ref}", status_code=204)
def delete_template(ref: str, ctx: Ctx, caller: Caller) -> Response:
    templates.delete_template(ctx, caller, ref)
    return Response(status_code=204)
