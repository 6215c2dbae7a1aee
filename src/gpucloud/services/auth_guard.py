"""Authentication behind the failure limits (ratelimit.py): refuse while a bucket is
empty, count each failure. Used by the API dependencies and the SSH gateway."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from gpucloud.core.errors import Unauthorized
from gpucloud.services.context import ServiceContext
from gpucloud.services.ratelimit import Policy

T = TypeVar("T")


def policy(ctx: ServiceContext) -> Policy:
    return Policy(ctx.settings.auth_failure_burst, ctx.settings.auth_failures_per_minute)


def _now(ctx: ServiceContext) -> float:
    return ctx.clock.now().timestamp()


def check(ctx: ServiceContext, keys: list[str]) -> None:
    """RateLimited while any of ``keys`` has no failures left."""
    ctx.auth_failures.check(keys, _now(ctx), policy(ctx))


def failed(ctx: ServiceContext, keys: list[str]) -> None:
    ctx.auth_failures.failed(keys, _now(ctx), policy(ctx))


def blocked(ctx: ServiceContext, keys: list[str]) -> bool:
    return ctx.auth_failures.retry_after(keys, _now(ctx), policy(ctx)) is not None


def authenticated(ctx: ServiceContext, keys: list[str], authenticate: Callable[[], T]) -> T:
    """``authenticate()`` unless ``keys`` are blocked; an Unauthorized it raises counts."""
    check(ctx, keys)
    try:
        return authenticate()
    except Unauthorized:
        failed(ctx, keys)
        raise
