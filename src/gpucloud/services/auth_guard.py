"""Authentication behind the failure limits (ratelimit.py): refuse while a bucket is
empty (unless the credential has authenticated from this address before), count each
failure, remember each success. Used by the API dependencies and the SSH gateway."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from gpucloud.core.errors import Unauthorized
from gpucloud.services.context import ServiceContext
from gpucloud.services.ratelimit import Limits, Policy

T = TypeVar("T")


def policy(ctx: ServiceContext) -> Policy:
    settings = ctx.settings
    return Policy(settings.auth_failure_burst, settings.auth_failures_per_minute,
                  settings.auth_failure_address_factor)


def _now(ctx: ServiceContext) -> float:
    return ctx.clock.now().timestamp()


def check(ctx: ServiceContext, limits: Limits) -> None:
    """RateLimited while any bucket of ``limits`` has no failures left (and its
    credential has not authenticated from its address before)."""
    ctx.auth_failures.check(limits, _now(ctx), policy(ctx))


def failed(ctx: ServiceContext, limits: Limits) -> None:
    ctx.auth_failures.failed(limits, _now(ctx), policy(ctx))


def succeeded(ctx: ServiceContext, limits: Limits) -> None:
    """An authentication of ``limits``' credential passed (from the cache too)."""
    ctx.auth_failures.succeeded(limits)


def blocked(ctx: ServiceContext, limits: Limits) -> bool:
    return ctx.auth_failures.retry_after(limits, _now(ctx), policy(ctx)) is not None


def authenticated(ctx: ServiceContext, limits: Limits, authenticate: Callable[[], T]) -> T:
    """``authenticate()`` unless ``limits`` are blocked; an Unauthorized it raises counts,
    a success is remembered."""
    check(ctx, limits)
    try:
        result = authenticate()
    except Unauthorized:
        failed(ctx, limits)
        raise
    succeeded(ctx, limits)
    return result
