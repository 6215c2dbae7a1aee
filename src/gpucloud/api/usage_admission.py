"""Admission of usage batches: ingest is deferrable work, API calls are not.

A node keeps its samples in its spool until the server acknowledges them
(agent/usage_spool.py), so the server may put a batch off; a person creating a pod cannot
be put off. So, per server process:

* **quiet** (no API call for ``quiet_seconds``): up to ``limit`` batches are ingested at
  once (on their own threads, never the request thread pool) and ``queue`` more wait for
  a thread; beyond that, 503;
* **busy** (an API call that changes something — POST, PUT, PATCH, DELETE, not to the
  agent protocol — started or ended within ``quiet_seconds`` in any worker on this host):
  one batch at a time and ``busy_queue`` waiting, others get 503. A waiting batch is
  deferred while the stretch of API calls is younger than ``defer_seconds`` (a burst
  passes first), then paced to ``busy_share`` of the time: after a batch that took ``t``
  seconds the next one starts ``t·(1/busy_share − 1)`` later.

A refused batch is answered 503 with ``Retry-After`` before its body is parsed, and
nothing of it is stored; the agent sends it again after that many seconds (backing off
while refusals go on). Ingest slows while people use the API and never stops: the
share guarantees progress under a constant stream of API calls.

Workers see each other's API calls through a shared 16-byte stamp (the last call and the
start of the stretch; ``time.monotonic`` is system-wide on Linux) in
``<home>/run/api-activity``; without it (a read-only home) each worker sees its own.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gpucloud.api.usage_worker import (
    IngestUnavailable,
    IngestWorker,
    parse_and_ingest,
    use_process,
)
from gpucloud.core.per_loop import PerLoop
from gpucloud.core.tunables import number_from_env
from gpucloud.core.usage import AgentUsageBatchOut, AgentUsageBatchRequest
from gpucloud.services.context import ServiceContext

#: Seconds a refused batch is told to wait (HTTP's Retry-After is whole seconds).
RETRY_AFTER_SECONDS = 1
#: While API calls run, ingest takes at most this share of one thread's time per worker,
#: once they have gone on for DEFER_SECONDS (until then it waits: bursts pass first).
BUSY_SHARE = 0.05
DEFER_SECONDS = 10.0
#: API calls closer together than this are one busy stretch.
QUIET_SECONDS = 0.5
#: How often a deferred batch looks whether the API calls are over.
_POLL_SECONDS = 0.05
T = TypeVar("T")
log = logging.getLogger(__name__)
_NOT_API = ("/v1/agent/", "/metrics", "/healthz")
#: Reads (status polls, ``usage`` reports, log follows) do not make ingest yield: a
#: client polling for its pod would otherwise hold its samples back.
_READS = frozenset({"GET", "HEAD", "OPTIONS"})


class ApiActivity:
    """When API calls last started or ended, and since when they have gone on without a
    quiet gap (``QUIET_SECONDS``); shared by the workers of one host (two doubles)."""

    def __init__(self, path: Path | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._local = [float("-inf"), float("-inf")]  # last, since
        self._shared: mmap.mmap | None = None
        if path is not None:
            self._shared = _open_shared(path)

    def _read(self) -> tuple[float, float]:
        if self._shared is None:
            return self._local[0], self._local[1]
        last, since = struct.unpack_from("dd", self._shared, 0)
        return float(last), float(since)

    def touch(self) -> None:
        now = self.clock()
        last, since = self._read()
        if now - last >= QUIET_SECONDS:
            since = now  # a new stretch of API calls
        self._local = [now, since]
        if self._shared is not None:
            struct.pack_into("dd", self._shared, 0, now, since)

    def last(self) -> float:
        return self._read()[0]

    def busy_since(self) -> float:
        """The start of the current stretch of API calls (meaningful while busy)."""
        return self._read()[1]


def _open_shared(path: Path) -> mmap.mmap | None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a+b") as file:
            if file.seek(0, 2) < 16:
                file.truncate(16)
            return mmap.mmap(file.fileno(), 16)
    except OSError:
        return None


def app_activity(app: Any) -> ApiActivity:
    """The app's view of API activity: the stamp shared under its home, made on first use
    (an app without a context yet, none shared)."""
    found: ApiActivity | None = getattr(app.state, "api_activity", None)
    if found is None:
        ctx = getattr(app.state, "ctx", None)
        path = ctx.settings.home / "run" / "api-activity" if ctx is not None else None
        found = app.state.api_activity = ApiActivity(path)
    return found


def is_api_call(path: str) -> bool:
    return not path.startswith(_NOT_API)


class ApiActivityMiddleware:
    """Stamps the start and end of every API call (pure ASGI: no cost per body chunk)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] in _READS
                or not is_api_call(scope["path"])):
            await self.app(scope, receive, send)
            return
        stamp = app_activity(scope["app"])
        stamp.touch()
        try:
            await self.app(scope, receive, send)
        finally:
            stamp.touch()


@dataclass
class IngestAdmission:
    """The per-process gate of ``POST /v1/agent/usage`` (used on its event loop only)."""

    activity: ApiActivity
    limit: int = 2
    queue: int = 8
    busy_queue: int = 2
    quiet_seconds: float = QUIET_SECONDS
    busy_share: float = BUSY_SHARE
    defer_seconds: float = DEFER_SECONDS
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    active: int = 0
    shed: int = 0
    _not_before: float = float("-inf")
    #: per event loop: the busy-time turn, the quiet-time slots and the ingest threads
    _turns: PerLoop[asyncio.Lock] = field(init=False)
    _slots: PerLoop[asyncio.Semaphore] = field(init=False)
    threads: PerLoop[anyio.CapacityLimiter] = field(init=False)

    def __post_init__(self) -> None:
        self._turns = PerLoop(asyncio.Lock)
        self._slots = PerLoop(lambda: asyncio.Semaphore(self.limit))
        self.threads = PerLoop(lambda: anyio.CapacityLimiter(self.limit))

    def busy(self) -> bool:
        return self.clock() - self.activity.last() < self.quiet_seconds

    def admit(self) -> bool:
        """Whether a batch may wait for its turn now (False: answer 503)."""
        room = 1 + self.busy_queue if self.busy() else self.limit + self.queue
        if self.active >= room:
            self.shed += 1
            return False
        return True

    def _slot(self) -> asyncio.Semaphore:
        """The ``limit`` quiet-time threads of this event loop: a batch waiting for one
        looks again whether API calls began meanwhile (then it takes its busy turn)."""
        return self._slots.get()

    async def _wait_turn(self) -> None:
        """Until the API calls stop, or they have gone on ``defer_seconds`` and the
        pacing after the previous batch is over."""
        while self.busy():
            ready = max(self._not_before, self.activity.busy_since() + self.defer_seconds)
            wait = ready - self.clock()
            if wait <= 0:
                return
            await self.sleep(min(wait, _POLL_SECONDS))

    async def run(self, work: Callable[[], Awaitable[T]]) -> T | None:
        """``work()`` once admitted and its turn has come; None: refused, not run."""
        if not self.admit():
            return None
        self.active += 1
        try:
            if not self.busy():
                async with self._slot():
                    if not self.busy():  # still quiet once a thread is free
                        return await work()
            async with self._turns.get():  # busy: one batch at a time, deferred, then paced
                await self._wait_turn()
                started = self.clock()
                try:
                    return await work()
                finally:
                    took = self.clock() - started
                    self._not_before = self.clock() + took * (1 / self.busy_share - 1)
        finally:
            self.active -= 1


# -- the route's work -----------------------------------------------------------------


def request_body_schema() -> dict[str, Any]:
    """``AgentUsageBatchRequest`` as the OpenAPI request body (the route reads the body
    itself, so FastAPI does not list it): definitions inlined, no ``$ref`` left."""
    schema = AgentUsageBatchRequest.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(definitions[node["$ref"].rsplit("/", 1)[1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": inline(schema)}}}}


def busy_share_from_env(default: float = BUSY_SHARE) -> float:
    """``GPUCLOUD_USAGE_BUSY_SHARE``: the share of time ingest may take while API calls
    run, in (0, 1]; anything else is ignored (logged) for the default."""
    share = number_from_env("GPUCLOUD_USAGE_BUSY_SHARE", default, 0.0, 1.0)
    return share if share > 0 else default


def _admission(app: Any) -> IngestAdmission:
    admission: IngestAdmission | None = getattr(app.state, "usage_admission", None)
    if admission is None:
        admission = app.state.usage_admission = IngestAdmission(
            app_activity(app), busy_share=busy_share_from_env())
    return admission


async def ingest(request: Request, ctx: ServiceContext, node_id: str
                 ) -> AgentUsageBatchOut | Response:
    """Admit, then parse, validate and store the batch on an ingest thread: none of a
    batch's JSON work runs on the event loop that serves the API calls."""
    admission = _admission(request.app)
    worker = _worker(request.app, ctx, admission)

    async def work() -> AgentUsageBatchOut | None:
        body = await request.body()
        if worker is None:
            return await anyio.to_thread.run_sync(parse_and_ingest, ctx, node_id, body,
                                                  limiter=admission.threads.get())
        try:
            return await anyio.to_thread.run_sync(worker.ingest, node_id, body,
                                                  ctx.clock.now(),
                                                  limiter=admission.threads.get())
        except IngestUnavailable:
            log.warning("usage ingest worker unavailable; batch shed (503)")
            return None

    stored = await admission.run(work)
    if stored is None:
        return JSONResponse(
            {"detail": "usage ingest is busy (it yields to API calls); send the batch again "
                       "after Retry-After, nothing of it was stored", "field": None},
            status_code=503, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    return stored


def _worker(app: Any, ctx: ServiceContext, admission: IngestAdmission) -> IngestWorker | None:
    """The app's niced ingest process (api/usage_worker.py), made on first use;
    None where batches are stored in this process (SQLite, ``GPUCLOUD_USAGE_INGEST``)."""
    if not hasattr(app.state, "usage_worker"):
        url = ctx.settings.database_url
        app.state.usage_worker = (
            IngestWorker(url, slots=admission.limit, activity=ctx.settings.home / "run"
                         / "api-activity", quiet_seconds=admission.quiet_seconds,
                         defer_seconds=admission.defer_seconds)
            if use_process(url) else None)
    found: IngestWorker | None = app.state.usage_worker
    return found


def close(app: Any) -> None:
    """Stop the app's ingest worker (at shutdown)."""
    worker: IngestWorker | None = getattr(app.state, "usage_worker", None)
    if worker is not None:
        worker.close()
