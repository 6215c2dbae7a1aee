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

And on PostgreSQL the renewals have a connection pool of their own (``lease_context``):
sharing the request pool, they waited for a connection behind a storm of registrations
that each held one while queued on a lock, and healthy nodes were marked ``Lost``. Its
statements are bounded (``STATEMENT_TIMEOUT_MS``, ``POOL_TIMEOUT_S``): the worst answer,
a 503, comes well inside the agent's timeout, which is itself inside the lease.

A renewal never waits for a node row another transaction holds (a scheduling pass's bind,
a pod report): the batched statement skips the row and answers ``BUSY``, and the renewal
goes with the next statement (``BUSY_RETRY_S`` later when nothing else is pending), for up
to ``BUSY_LIMIT_S``. The full path's row lock waited instead, on one of its
``LEASE_THREADS``, so a bind of a thousand nodes queued the renewals of them (and any new
grant behind those) until its commit (bench/lease_vs_bind.py, docs/replicas.md).
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TypeVar

import anyio
import anyio.to_thread
from fastapi import HTTPException

from gpucloud.core.models import LeaseRequest, LeaseResponse
from gpucloud.core.per_loop import PerLoop
from gpucloud.core.tunables import number_from_env
from gpucloud.db.session import Database
from gpucloud.services import lease_batch, lease_ttl
from gpucloud.services.context import ServiceContext

#: Threads for the renewals' full path (new grants, stale tokens, health news).
LEASE_THREADS = 4
#: Threads for the batched statements (one flush at a time per database and loop).
FLUSH_THREADS = 2
#: A lease statement that waits longer (a node row a scheduling pass holds) is cancelled.
STATEMENT_TIMEOUT_MS = 2000
#: The longest wait for one of the lease pool's connections.
POOL_TIMEOUT_S = 1.0
#: A renewal that waited in this server longer than this fraction of the TTL before its
#: statement is refused (503), not applied late: the agent gave it up at TTL/2 and sent
#: another, and one applied late would keep a dead agent's node alive past TTL + 2 s.
MAX_WAIT_FRACTION = 0.5
#: A renewal whose row was held is sent again this long after, when nothing else is
#: pending (else with the next statement at once) …
BUSY_RETRY_S = 0.02
#: … for at most this long: then the full path, whose statement waits for the row (cut at
#: ``STATEMENT_TIMEOUT_MS``: a 503). ``GPUCLOUD_LEASE_BUSY_LIMIT`` overrides it, for
#: benchmarks (0: the full path at once, as before renewals were sent again).
BUSY_LIMIT_S = number_from_env("GPUCLOUD_LEASE_BUSY_LIMIT", 2.0, 0.0, 60.0)
T = TypeVar("T")

#: The lease path's own database (its own pool) per server database (PostgreSQL).
_LEASE_DBS: weakref.WeakKeyDictionary[Database, ServiceContext] = weakref.WeakKeyDictionary()
_LEASE_DBS_LOCK = threading.Lock()


def lease_context(ctx: ServiceContext) -> ServiceContext:
    """``ctx`` with the lease path's own connection pool (PostgreSQL; SQLite has a single
    writer, and an in-memory database cannot be opened twice: ``ctx`` itself). One
    connection per lease thread, so a renewal never waits for the request pool."""
    if ctx.db.is_sqlite:
        return ctx
    with _LEASE_DBS_LOCK:
        found = _LEASE_DBS.get(ctx.db)
        if found is None:
            size = LEASE_THREADS + FLUSH_THREADS
            db = Database(ctx.db.url, pool_size=size, max_overflow=0,
                          pool_timeout=POOL_TIMEOUT_S, connect_args={
                              "options": f"-c statement_timeout={STATEMENT_TIMEOUT_MS}"})
            found = _LEASE_DBS[ctx.db] = replace(ctx, db=db)
        return found


def close(db: Database) -> None:
    """Dispose of the lease pool made for ``db`` (the server's shutdown)."""
    with _LEASE_DBS_LOCK:
        found = _LEASE_DBS.pop(db, None)
    if found is not None:
        found.db.dispose()


#: A renewal waiting for a statement, and where its answer goes.
_Waiting = tuple[lease_batch.Renewal, "asyncio.Future[LeaseResponse | None]"]


@dataclass
class _Batcher:
    """The renewals waiting for the next statement on one event loop and database."""

    pending: list[_Waiting] = field(default_factory=list)
    flushing: bool = False


@dataclass
class _LoopState:
    #: the full path's threads (new grants, stale tokens, health news)
    limiter: anyio.CapacityLimiter
    #: the batched statements' own: a wave of full-path renewals (nodes just marked Lost
    #: asking for new grants) must not hold up the statement that renews all the others
    flushes: anyio.CapacityLimiter
    batchers: dict[int, _Batcher] = field(default_factory=dict)


#: One limiter and batcher set per event loop (a limiter belongs to the loop it was made
#: in; a test app's loop that is gone takes its state with it).
_STATES = PerLoop(lambda: _LoopState(anyio.CapacityLimiter(LEASE_THREADS),
                                     anyio.CapacityLimiter(FLUSH_THREADS)))


def _state() -> _LoopState:
    return _STATES.get()


def limiter() -> anyio.CapacityLimiter:
    return _state().limiter


async def run(function: Callable[[ServiceContext], T], ctx: ServiceContext) -> T:
    """``function(ctx)`` on one of the lease threads, on the lease pool."""
    return await anyio.to_thread.run_sync(function, lease_context(ctx), limiter=limiter())


def check_fresh(ctx: ServiceContext, received_at: datetime | None) -> None:
    """Refuse (503) a renewal that has waited here too long (``MAX_WAIT_FRACTION``)."""
    if received_at is None:
        return
    waited = (ctx.clock.now() - received_at).total_seconds()
    if waited > lease_ttl.cached(ctx) * MAX_WAIT_FRACTION:  # no query: on the event loop
        raise HTTPException(503, f"the renewal waited {waited:.1f} s in a busy server; "
                                 "send it again")


async def renew_current(ctx: ServiceContext, token: str, request: LeaseRequest,
                        received_at: datetime | None = None) -> LeaseResponse | None:
    """``nodes.renew_current``, batched with the renewals that arrive meanwhile: the
    response, or None when the full path must answer (as there). ``received_at``: when
    the request came (the expiry counts from there; too long ago: 503, ``check_fresh``)."""
    if not lease_batch.eligible(token, request):
        return None
    state = _state()
    ctx = lease_context(ctx)
    batcher = state.batchers.setdefault(id(ctx.db), _Batcher())
    future: asyncio.Future[LeaseResponse | None] = asyncio.get_running_loop().create_future()
    batcher.pending.append((lease_batch.Renewal(token, request, received_at), future))
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
            taken = _refuse_late(ctx, batcher.pending)
            batcher.pending = []
            if not taken:
                continue
            try:
                results = await anyio.to_thread.run_sync(
                    lease_batch.renew_many, ctx, [r for r, _ in taken], limiter=threads)
            except Exception as error:  # noqa: BLE001 - each waiting request gets it
                for _, future in taken:
                    if not future.done():
                        future.set_exception(error)
                continue
            busy: list[_Waiting] = []
            for (renewal, future), result in zip(taken, results, strict=True):
                if isinstance(result, lease_batch.Busy):
                    again = _busy(renewal, future)
                    if again is not None:
                        busy.append(again)
                elif not future.done():
                    future.set_result(result)
            if busy:
                if not batcher.pending:  # only the held rows: give their holders a moment
                    await asyncio.sleep(BUSY_RETRY_S)
                batcher.pending = busy + batcher.pending
    finally:
        batcher.flushing = False


def _busy(renewal: lease_batch.Renewal,
          future: asyncio.Future[LeaseResponse | None]) -> _Waiting | None:
    """A renewal whose row was held, to send again; None once it has been held for
    ``BUSY_LIMIT_S`` (its answer, None, sends it to the full path)."""
    if future.done():  # its request went away meanwhile
        return None
    now = time.monotonic()
    since = renewal.busy_since if renewal.busy_since is not None else now
    if now - since >= BUSY_LIMIT_S:
        if not future.done():
            future.set_result(None)
        return None
    return replace(renewal, busy_since=since), future


def _refuse_late(ctx: ServiceContext, pending: list[_Waiting]) -> list[_Waiting]:
    """The pending renewals still fresh; the others get their 503 now."""
    fresh = []
    for renewal, future in pending:
        try:
            check_fresh(ctx, renewal.received_at)
        except HTTPException as error:
            if not future.done():
                future.set_exception(error)
            continue
        fresh.append((renewal, future))
    return fresh
