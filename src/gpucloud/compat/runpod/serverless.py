"""RunPod's serverless HTTP API: the client side (``/v2/{endpoint}/run`` …, what
``runpod.Endpoint`` calls) and the worker side (``/v2/_worker/{endpoint}/…``, what the
``runpod`` SDK's ``serverless/modules`` call with the URLs of ``endpoints.worker_env``).

Long polls (``runsync``, ``job-take``, ``job-stop``) are async routes that hold no
database connection and no threadpool thread while they wait: each check is one short
query in the threadpool, and the wait is an ``asyncio.Event`` from
``serverless_queue.WAKEUPS`` with a periodic re-check (a change on another replica).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from gpucloud.api.deps import Ctx
from gpucloud.compat.runpod.rest_common import RUNPOD_KEY_HEADER, RunpodCaller, key_of
from gpucloud.core.errors import InvalidInput
from gpucloud.core.serverless import RunRequest
from gpucloud.services import auth_guard, endpoints, ratelimit, serverless_queue
from gpucloud.services.context import ServiceContext
from gpucloud.services.serverless_queue import POLL_FALLBACK_SECONDS, WAKEUPS
from gpucloud.services.wakeups import wait

router = APIRouter(prefix="/v2", tags=["serverless"])
T = TypeVar("T")

DEFAULT_RUNSYNC_WAIT_MS = 90_000


async def _long_poll(key: str, seconds: float,
                     check: Callable[[], Awaitable[T | None]]) -> T | None:
    """``check()`` until it returns something or ``seconds`` pass; between checks wait
    for a wake-up on ``key`` (listening before each check, so none is missed)."""
    deadline = time.monotonic() + seconds
    while True:
        with WAKEUPS.listen(key) as woken:
            found = await check()
            remaining = deadline - time.monotonic()
            if found is not None or remaining <= 0:
                return found
            await wait(woken, min(remaining, POLL_FALLBACK_SECONDS))


# --- the client API ----------------------------------------------------------------


def _wake_controllers(request: Request) -> None:
    runner = getattr(request.app.state, "controllers", None)
    if runner is not None:
        runner.wake()  # scale from zero without waiting a full interval


def _submitted(body: RunRequest) -> dict[str, Any]:
    """The fields the queue reads (``input`` even when null)."""
    return {**body.model_dump(mode="json", exclude_none=True, include={"webhook", "policy"}),
            "input": body.input}


@router.post("/{endpoint_id}/run")
def run(endpoint_id: str, body: RunRequest, request: Request, ctx: Ctx,
        caller: RunpodCaller) -> dict[str, Any]:
    """Queue a request; returns ``{"id", "status": "IN_QUEUE"}`` to poll."""
    job = serverless_queue.submit(ctx, caller, endpoint_id, _submitted(body), sync=False)
    _wake_controllers(request)
    return job


@router.post("/{endpoint_id}/runsync")
async def runsync(endpoint_id: str, body: RunRequest, request: Request, ctx: Ctx,
                  caller: RunpodCaller,
                  wait_ms: Annotated[int, Query(alias="wait", ge=1000, le=300_000)] = (
                      DEFAULT_RUNSYNC_WAIT_MS)) -> dict[str, Any]:
    """Queue a request and wait for its result up to ``?wait=`` ms (default 90 s);
    otherwise the request to poll with ``/status``. The server may hold it less
    (``serverless_runsync_max_wait_seconds``)."""
    job = await run_in_threadpool(serverless_queue.submit, ctx, caller, endpoint_id,
                                  _submitted(body), True)
    _wake_controllers(request)
    read = partial(serverless_queue.status, ctx, caller, endpoint_id, job["id"])

    async def finished() -> dict[str, Any] | None:
        state = await run_in_threadpool(read)
        return state if state["status"] not in ("IN_QUEUE", "IN_PROGRESS") else None

    seconds = min(wait_ms / 1000, ctx.settings.serverless_runsync_max_wait_seconds)
    done = await _long_poll(f"r:{job['id']}", seconds, finished)
    return done if done is not None else await run_in_threadpool(read)


@router.get("/{endpoint_id}/status/{request_id}")
def status(endpoint_id: str, request_id: str, ctx: Ctx,
           caller: RunpodCaller) -> dict[str, Any]:
    """``id, status, delayTime, executionTime, output`` (and ``error``) of a request."""
    return serverless_queue.status(ctx, caller, endpoint_id, request_id)


@router.get("/{endpoint_id}/stream/{request_id}")
def stream(endpoint_id: str, request_id: str, ctx: Ctx,
           caller: RunpodCaller) -> dict[str, Any]:
    """The stream chunks since the last call (``stream`` is always there)."""
    return serverless_queue.stream(ctx, caller, endpoint_id, request_id)


@router.post("/{endpoint_id}/cancel/{request_id}")
def cancel(endpoint_id: str, request_id: str, ctx: Ctx,
           caller: RunpodCaller) -> dict[str, Any]:
    return serverless_queue.cancel(ctx, caller, endpoint_id, request_id)


@router.get("/{endpoint_id}/health")
def health(endpoint_id: str, ctx: Ctx, caller: RunpodCaller) -> dict[str, Any]:
    """``{"jobs": {completed, failed, inProgress, inQueue, retried}, "workers": {idle,
    running}}``."""
    return serverless_queue.health(ctx, caller, endpoint_id)


@router.post("/{endpoint_id}/purge-queue")
def purge_queue(endpoint_id: str, ctx: Ctx, caller: RunpodCaller) -> dict[str, Any]:
    """Cancel every queued request (running ones go on)."""
    return {"removed": serverless_queue.purge(ctx, caller, endpoint_id),
            "status": "completed"}


# --- the worker API ----------------------------------------------------------------


async def worker_pod(request: Request, ctx: Ctx, endpoint_id: str, worker_id: str,
                     header: Annotated[str | None, Depends(RUNPOD_KEY_HEADER)]) -> str:
    """The worker pod's id: ``Authorization: KEY`` (no Bearer, as the SDK sends it) must
    be a worker key of the endpoint; failures count against the same rate limits."""
    key = key_of(header, None)
    limit_keys = ratelimit.api_keys(request.client.host if request.client else None, key)
    auth_guard.check(ctx, limit_keys)
    return await run_in_threadpool(
        auth_guard.authenticated, ctx, limit_keys,
        partial(endpoints.authenticate_worker, ctx, key, endpoint_id, worker_id))


WorkerPod = Annotated[str, Depends(worker_pod)]
_WORKER = "/_worker/{endpoint_id}"


def _poll_seconds(ctx: ServiceContext) -> float:
    return ctx.settings.serverless_long_poll_seconds


async def _take(ctx: ServiceContext, endpoint_id: str, pod_id: str,
                batch_size: int) -> list[dict[str, Any]] | None:
    async def check() -> list[dict[str, Any]] | None:
        jobs = await run_in_threadpool(serverless_queue.take, ctx, endpoint_id, pod_id,
                                       batch_size)
        return jobs or None

    return await _long_poll(f"q:{endpoint_id}", _poll_seconds(ctx), check)


@router.get(_WORKER + "/job-take/{worker_id}", response_model=None)
async def job_take(endpoint_id: str, ctx: Ctx, pod_id: WorkerPod) -> Response:
    """One job ``{"id", "input"}``, or 204 when none came within the long poll (the
    SDK's ``job_in_progress`` flag is not needed: the queue knows what it runs)."""
    jobs = await _take(ctx, endpoint_id, pod_id, 1)
    return JSONResponse(jobs[0]) if jobs else Response(status_code=204)


@router.get(_WORKER + "/job-take-batch/{worker_id}", response_model=None)
async def job_take_batch(endpoint_id: str, ctx: Ctx, pod_id: WorkerPod,
                         batch_size: Annotated[int, Query(ge=1, le=64)] = 1) -> Response:
    """Up to ``batch_size`` jobs as a list, or 204."""
    jobs = await _take(ctx, endpoint_id, pod_id, batch_size)
    return JSONResponse(jobs) if jobs else Response(status_code=204)


async def _json_body(request: Request) -> Any:
    """The SDK posts JSON as ``application/x-www-form-urlencoded``: parse the raw body."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InvalidInput("body", "must be JSON") from None


@router.post(_WORKER + "/job-done/{worker_id}/{job_id}")
async def job_done(job_id: str, request: Request, ctx: Ctx, pod_id: WorkerPod,
                   is_stream: Annotated[str, Query(alias="isStream")] = "false",
                   ) -> dict[str, Any]:
    """A result (``output`` and/or ``error``), or a progress update (``"status":
    "IN_PROGRESS"``). A late result (cancelled, timed out, re-leased) is accepted and
    dropped: ``{"accepted": false}``."""
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise InvalidInput("body", "must be a JSON object")
    if body.get("status") == "IN_PROGRESS":
        accepted = await run_in_threadpool(serverless_queue.progress, ctx, pod_id, job_id,
                                           body.get("output"))
    else:
        accepted = await run_in_threadpool(serverless_queue.finish, ctx, pod_id, job_id,
                                           body, is_stream.lower() == "true")
    return {"accepted": accepted}


@router.post(_WORKER + "/job-stream/{worker_id}/{job_id}")
async def job_stream(job_id: str, request: Request, ctx: Ctx,
                     pod_id: WorkerPod) -> dict[str, Any]:
    """One stream chunk (``{"output": …}``) of a running request."""
    body = await _json_body(request)
    chunks = body if isinstance(body, list) else [body]
    accepted = await run_in_threadpool(serverless_queue.add_stream_chunks, ctx, pod_id,
                                       job_id, chunks)
    return {"accepted": accepted}


@router.get(_WORKER + "/ping/{worker_id}")
def ping(ctx: Ctx, pod_id: WorkerPod, job_id: str | None = None,
         status: str | None = None) -> dict[str, Any]:
    """The heartbeat: renews the leases of the jobs it names (``job_id=a,b``);
    ``status=unhealthy`` (the worker exits) lets its leases lapse now."""
    if status == "unhealthy":
        return {"requeued": serverless_queue.worker_unhealthy(ctx, pod_id)}
    ids = [part for part in (job_id or "").split(",") if part]
    return {"renewed": serverless_queue.renew(ctx, pod_id, ids[:256])}


@router.get(_WORKER + "/job-stop/{worker_id}", response_model=None)
async def job_stop(ctx: Ctx, pod_id: WorkerPod) -> Response:
    """``{"jobsToStop": [...]}`` (cancelled or timed out), or 204 after the long poll."""
    async def check() -> list[str] | None:
        return await run_in_threadpool(serverless_queue.stop_signals, ctx, pod_id) or None

    ids = await _long_poll(f"stop:{pod_id}", _poll_seconds(ctx), check)
    return JSONResponse({"jobsToStop": ids}) if ids else Response(status_code=204)
