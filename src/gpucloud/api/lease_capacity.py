"""The lease renewals' own capacity: their own threads, and renewals batched.

A sync route runs in AnyIO's default thread pool, 40 threads that every other sync route
shares; under a burst of pod creates or status reports a renewal waited there behind them,
its lease lapsed, and a healthy node was marked ``Lost``. So the lease route is async and
does its database work on threads of its own (``CapacityLimiter``s per event loop: the
batched statements' and the full path's apart), which no other route can take.

And it does little of it: the current renewals that arrive while one statement is out are
renewed together by the next (``services.lease_batch``; one at a time per event loop and
database, so at low load a renewal is still one statement, at once). A thousand renewals a
second then cost tens of statements and round trips, not a thousand threads' turns, which
on a loaded machine (the GIL, a CPU shared with the controllers) is what limited them.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import anyio.to_thread

from gpucloud.core.models import LeaseRequest, LeaseResponse
from gpucloud.services import lease_batch
from gpucloud.services.context import ServiceContext

#: Threads for the renewals' full path (new grants, stale tokens, health news).
LEASE_THREADS = 4
#: Threads for the batched statements (one flush at a time per database and loop).
FLUSH_THREADS = 2
T = TypeVar("T")


@dataclass
class _Batcher:
    """The renewals waiting for the next statement on one event loop and database."""

    pending: list[tuple[lease_batch.Renewal, asyncio.Future[LeaseResponse | None]]] = field(
        default_factory=list)
    flushing: bool = False


@dataclass
class _LoopState:
    #: the full path's threads (new grants, stale tokens, health news)
    limiter: anyio.CapacityLimiter
    #: the batched statements' own: a wave of full-path renewals (nodes just marked Lost
    #: asking for new grants) must not hold up the statement that renews all the others
    flushes: anyio.CapacityLimiter
    batchers: dict[int, _Batcher] = field(default_factory=dict)


_LOOPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = (
    weakref.WeakKeyDictionary())


def _state() -> _LoopState:
    """One limiter and batcher set per event loop (a limiter belongs to the loop it was
    made in; a test app's loop that is gone takes its state with it)."""
    loop = asyncio.get_running_loop()
    found = _LOOPS.get(loop)
    if found is None:
        found = _LOOPS[loop] = _LoopState(anyio.CapacityLimiter(LEASE_THREADS),
                                          anyio.CapacityLimiter(FLUSH_THREADS))
    return found


def limiter() -> anyio.CapacityLimiter:
    return _state().limiter


async def run(function: Callable[[ServiceContext], T], ctx: ServiceContext) -> T:
    """``function(ctx)`` on one of the lease threads."""
    return await anyio.to_thread.run_sync(function, ctx, limiter=limiter())


async def renew_current(ctx: ServiceContext, token: str,
                        request: LeaseRequest) -> LeaseResponse | None:
    """``nodes.renew_current``, batched with the renewals that arrive meanwhile: the
    response, or None when the full path must answer (as there)."""
    if not lease_batch.eligible(token, request):
        return None
    state = _state()
    batcher = state.batchers.setdefault(id(ctx.db), _Batcher())
    future: asyncio.Future[LeaseResponse | None] = asyncio.get_running_loop().create_future()
    batcher.pending.append((lease_batch.Renewal(token, request), future))
    if not batcher.flushing:
        batcher.flushing = True
        task = asyncio.create_task(_flush(ctx, batcher, state.flushes))
        _TASKS.add(task)
        task.add_done_callback(_TASKS.discard)
    return await future


#: The running flushes (the loop keeps only weak references to tasks).
_TASKS: set[asyncio.Task[None]] = set()


async def _flush(ctx: ServiceContext, batcher: _Batcher,
                 threads: anyio.CapacityLimiter) -> None:
    """Renew what is pending, statement after statement, until nothing is."""
    try:
        while batcher.pending:
            taken, batcher.pending = batcher.pending, []
            try:
                results = await anyio.to_thread.run_sync(
                    lease_batch.renew_many, ctx, [r for r, _ in taken], limiter=threads)
            except Exception as error:  # noqa: BLE001 - each waiting request gets it
                for _, future in taken:
                    if not future.done():
                        future.set_exception(error)
                continue
            for (_, future), result in zip(taken, results, strict=True):
                if not future.done():
                    future.set_result(result)
    finally:
        batcher.flushing = False
