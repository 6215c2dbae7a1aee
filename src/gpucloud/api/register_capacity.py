"""Registrations' own capacity: a few threads of their own, a bounded queue, and a
freshness guard.

A registration costs about 11 ms of a replica's CPU. As a sync route it ran in AnyIO's
default thread pool, the 40 threads that the long polls' and the full-path renewals'
database work shares; a fleet booting at once then queued behind them, registrations
waited past the agent's 30 s, the agent sent each again, and the server still did every
one it had queued: each retry a re-registration (a new node token, a new grant) on top.
So here, per event loop:

* at most ``REGISTER_THREADS`` registrations run at once, on threads no other route takes,
  and at most as many more wait for one as those threads start within half of
  ``START_WITHIN_S`` at the recent pace (and never over ``REGISTER_QUEUE``); beyond that
  a registration is refused at once, 503 with ``Retry-After`` (the agent backs off with
  jitter and sends it again; a refusal costs no database work and is never a half-done
  registration). A waiting registration is cheap, one that would wait too long is not:
  at 11 ms each the queue may be long, on a starved replica it is short;
* one that waited here longer than ``START_WITHIN_S`` before its turn is refused the
  same way without doing any of its work, and one whose work is not done within
  ``COMMIT_WITHIN_S`` of its arrival is rolled back before its commit (its join token's
  use given back): its agent, whose request times out at ``AGENT_TIMEOUT_S``, has given
  it up or is about to, and its retry must not find its node token replaced by a
  registration nobody received.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import TypeVar

import anyio
import anyio.to_thread
from fastapi import HTTPException

from gpucloud.core.per_loop import PerLoop
from gpucloud.services.context import ServiceContext

#: Registrations at once per event loop (a registration is ~11 ms of CPU: a few threads
#: keep a replica's share of them busy without taking the CPU from the renewals).
REGISTER_THREADS = 4
#: The most registrations that may wait for a thread; beyond these, 503 at once.
REGISTER_QUEUE = 512
#: The pace assumed before any registration was timed (seconds of one's work).
INITIAL_PACE_S = 0.05
#: The agent's timeout for a registration (client/sdk.py: the client's default).
AGENT_TIMEOUT_S = 30.0
#: A registration that has not started within this of its arrival is refused (it would
#: hardly be done, and answered, within the agent's timeout).
START_WITHIN_S = 20.0
#: A registration not done within this of its arrival is rolled back before its commit.
COMMIT_WITHIN_S = AGENT_TIMEOUT_S - 2.0
#: What a refused registration is told to wait (whole seconds).
RETRY_AFTER_S = 2
T = TypeVar("T")


@dataclass
class _Admission:
    limiter: anyio.CapacityLimiter
    queue: int
    #: registrations running or waiting for a thread
    admitted: int = 0
    #: how long one registration's work takes here lately (a moving average, seconds)
    pace_s: float = INITIAL_PACE_S

    def bound(self) -> int:
        """Registrations admitted at most: running, and waiting no longer than half of
        ``START_WITHIN_S`` at the recent pace."""
        threads = int(self.limiter.total_tokens)
        waiting = int(threads * START_WITHIN_S / 2 / max(self.pace_s, 1e-3))
        return threads + max(1, min(self.queue, waiting))

    def timed(self, seconds: float) -> None:
        self.pace_s += (seconds - self.pace_s) * 0.2


#: This event loop's (a limiter belongs to the loop it was made in).
_ADMISSIONS = PerLoop(lambda: _Admission(anyio.CapacityLimiter(REGISTER_THREADS),
                                         REGISTER_QUEUE))


def admission() -> _Admission:
    return _ADMISSIONS.get()


def busy(detail: str) -> HTTPException:
    return HTTPException(503, f"{detail}; register again after Retry-After",
                         headers={"Retry-After": str(RETRY_AFTER_S)})


def check_fresh(ctx: ServiceContext, received_at: datetime, within: float) -> None:
    """Refuse (503) a registration that came more than ``within`` seconds ago."""
    waited = (ctx.clock.now() - received_at).total_seconds()
    if waited > within:
        raise busy(f"the registration waited {waited:.1f} s in a busy server and was "
                   "not done")


async def run(ctx: ServiceContext, received_at: datetime,
              work: Callable[[Callable[[], None]], T]) -> T:
    """``work(before_commit)`` on a registration thread, if admitted and still fresh;
    ``before_commit`` raises once the registration is too late to commit."""
    state = admission()
    if state.admitted >= state.bound():
        raise busy(f"{state.admitted} registrations are under way here")
    state.admitted += 1
    try:
        return await anyio.to_thread.run_sync(_fresh_work, ctx, received_at, work, state,
                                              limiter=state.limiter)
    finally:
        state.admitted -= 1


def _fresh_work(ctx: ServiceContext, received_at: datetime,
                work: Callable[[Callable[[], None]], T], state: _Admission) -> T:
    check_fresh(ctx, received_at, START_WITHIN_S)
    started = time.monotonic()
    try:
        return work(partial(check_fresh, ctx, received_at, COMMIT_WITHIN_S))
    finally:
        state.timed(time.monotonic() - started)
