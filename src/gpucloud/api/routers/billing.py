"""/v1/prices, /v1/usage, /v1/invoices and /v1/projects/{project}/spend-limit."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter

from gpucloud.api.deps import Admin, Caller, Ctx
from gpucloud.core.billing import (
    InvoiceOut,
    PriceOut,
    PriceSetRequest,
    SpendLimitOut,
    SpendLimitSetRequest,
    UsageBy,
    UsageOut,
    as_utc,
)
from gpucloud.core.errors import InvalidInput
from gpucloud.core.models import ErrorOut
from gpucloud.services import billing, prices, spend

router = APIRouter(tags=["billing"])


def _time(field: str, value: str | None) -> datetime | None:
    """An ISO 8601 time in UTC (given without a zone: UTC); 422 naming ``field``.

    Parsed here rather than by FastAPI, whose lax mode takes a bare number for a time."""
    if value is None:
        return None
    try:
        return as_utc(datetime.fromisoformat(value))
    except ValueError as error:
        raise InvalidInput(field, f"{value!r} is not an ISO 8601 time ({error})") from None


@router.get("/v1/prices")
def list_prices(ctx: Ctx, caller: Caller) -> list[PriceOut]:
    del caller  # any authenticated caller may read the price list
    return prices.list_prices(ctx)


@router.post("/v1/prices", status_code=201)
def set_price(body: PriceSetRequest, ctx: Ctx, caller: Admin) -> PriceOut:
    return prices.set_price(ctx, caller, body)


@router.get("/v1/usage", responses={
    404: {"model": ErrorOut, "description": "No such project, or not the caller's"}})
def usage(ctx: Ctx, caller: Caller, project: str | None = None, since: str | None = None,
          until: str | None = None, by: UsageBy = UsageBy.POD) -> UsageOut:
    """``since``/``until``: ISO 8601 times (UTC when no zone); default the last 30 days."""
    return billing.usage(ctx, caller, project, _time("since", since), _time("until", until),
                         by)


@router.get("/v1/invoices/{project}")
def invoice(project: str, month: str, ctx: Ctx, caller: Caller) -> InvoiceOut:
    return billing.invoice(ctx, caller, project, month)


@router.get("/v1/projects/{project}/spend-limit")
def get_spend_limit(project: str, ctx: Ctx, caller: Caller) -> SpendLimitOut:
    return spend.get_limit(ctx, caller, project)


@router.put("/v1/projects/{project}/spend-limit")
def set_spend_limit(project: str, body: SpendLimitSetRequest, ctx: Ctx,
                    caller: Admin) -> SpendLimitOut:
    return spend.set_limit(ctx, caller, project, body)
