"""/v1/projects and /v1/keys: tenants and their API keys."""

from __future__ import annotations

from fastapi import APIRouter

from gpucloud.api.deps import Admin, Caller, Ctx
from gpucloud.core.models import (
    KeyCreatedOut,
    KeyCreateRequest,
    KeyOut,
    ProjectCreatedOut,
    ProjectCreateRequest,
    ProjectOut,
)
from gpucloud.services import projects

router = APIRouter(tags=["projects"])


@router.post("/v1/projects", status_code=201)
def create_project(body: ProjectCreateRequest, ctx: Ctx, caller: Admin) -> ProjectCreatedOut:
    return projects.create_project(ctx, caller, body.name)


@router.get("/v1/projects")
def list_projects(ctx: Ctx, caller: Caller) -> list[ProjectOut]:
    return projects.list_projects(ctx, caller)


@router.post("/v1/keys", status_code=201)
def create_key(body: KeyCreateRequest, ctx: Ctx, caller: Caller) -> KeyCreatedOut:
    return projects.create_key(ctx, caller, body.name)


@router.get("/v1/keys")
def list_keys(ctx: Ctx, caller: Caller) -> list[KeyOut]:
    return projects.list_keys(ctx, caller)


@router.post("/v1/keys/{ref}/revoke")
def revoke_key(ref: str, ctx: Ctx, caller: Caller) -> KeyOut:
    return projects.revoke_key(ctx, caller, ref)
