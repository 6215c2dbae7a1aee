"""/v1/priority-classes and /v1/quotas: scheduling policy (writes are admin-only)."""

from __future__ import annotations

from fastapi import APIRouter

from gpucloud.api.deps import Admin, Caller, Ctx
from gpucloud.core.policy import (
    PriorityClassCreateRequest,
    PriorityClassOut,
    QuotaOut,
    QuotaSetRequest,
)
from gpucloud.services import priorities, quotas

router = APIRouter(tags=["policy"])


@router.get("/v1/priority-classes")
def list_priority_classes(ctx: Ctx, caller: Caller) -> list[PriorityClassOut]:
    del caller  # any authenticated caller may read them
    return priorities.list_classes(ctx)


@router.post("/v1/priority-classes", status_code=201)
def create_priority_class(body: PriorityClassCreateRequest, ctx: Ctx,
                          caller: Admin) -> PriorityClassOut:
    return priorities.create_class(ctx, caller, body)


@router.get("/v1/quotas")
def list_quotas(ctx: Ctx, caller: Caller) -> list[QuotaOut]:
    return quotas.list_quotas(ctx, caller)


@router.put("/v1/quotas/{project}")
def set_quota(project: str, body: QuotaSetRequest, ctx: Ctx, caller: Admin) -> QuotaOut:
    return quotas.set_quota(ctx, caller, project, body)
