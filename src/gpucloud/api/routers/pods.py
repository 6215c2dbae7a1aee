"""/v1/pods: pods of the caller's project."""

from __future__ import annotations

import time
from functools import partial

from fastapi import APIRouter, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from gpucloud.api.deps import Caller, Ctx
from gpucloud.core.models import (
    MAX_GPUS_PER_POD,
    PodCreateRequest,
    PodEventOut,
    PodLogsOut,
    PodOut,
    PodWhyOut,
)
from gpucloud.core.phases import PodPhase
from gpucloud.core.trace import mark
from gpucloud.services import pods, wakeups

router = APIRouter(prefix="/v1/pods", tags=["pods"])
#: The longest ``?wait=`` of a log read (the server may hold it less:
#: ``Settings.log_wait_max_seconds``).
MAX_LOG_WAIT_SECONDS = 30.0


def _wake_scheduler(request: Request) -> None:
    runner = getattr(request.app.state, "controllers", None)
    if runner is not None:
        runner.wake()


@router.post("", status_code=201, response_model=PodOut)
def create_pod(body: PodCreateRequest, ctx: Ctx, caller: Caller, request: Request) -> Response:
    pod = pods.create_pod(ctx, caller, body)
    mark("server.create.committed", pod=pod.id)
    _wake_scheduler(request)
    # Serialized once here; returning the model would validate it a second time.
    return Response(pod.model_dump_json(), status_code=201, media_type="application/json")


@router.get("")
def list_pods(ctx: Ctx, caller: Caller, phase: PodPhase | None = None,
              limit: int = Query(default=1000, ge=1, le=10000)) -> list[PodOut]:
    return pods.list_pods(ctx, caller, phase, limit)


@router.get("/{ref}")
def get_pod(ref: str, ctx: Ctx, caller: Caller) -> PodOut:
    return pods.get_pod(ctx, caller, ref)


@router.get("/{ref}/events")
def pod_events(ref: str, ctx: Ctx, caller: Caller) -> list[PodEventOut]:
    return pods.list_events(ctx, caller, ref)


@router.get("/{ref}/why")
def pod_why(ref: str, ctx: Ctx, caller: Caller) -> PodWhyOut:
    return pods.why_pod(ctx, caller, ref)


@router.get("/{ref}/logs")
async def pod_logs(
    ref: str, ctx: Ctx, caller: Caller, offset: int = Query(default=0, ge=0),
    tail: int | None = Query(default=None, ge=0),
    attempt: int | None = Query(default=None, ge=0),
    wait: float = Query(default=0, ge=0, le=MAX_LOG_WAIT_SECONDS, description=(
        "Seconds to wait for output past `offset` (0 to 30; 0: answer at once). The read "
        "answers as soon as there is some, the pod has finished, or a newer attempt than "
        "`attempt` began; else with no text once the wait is over.")),
) -> PodLogsOut:
    """The pod's output from byte ``offset`` (see ``pods.read_logs``); with ``wait``, a
    long poll for the next output.

    An async route that holds no thread while it waits: each read is one short read in the
    threadpool, and the wait is ``wakeups.LOGS`` of the pod, which the log ingest notifies
    after its commit (api/routers/agent.py) here and, through the ``LISTEN/NOTIFY``
    bridge, on the other replicas (services/notify.py), which publish it only while a
    replica follows the pod (``wakeups.LOGS.follow``). A wake-up is a hint: the log is
    re-read at least every ``Settings.log_wait_recheck_seconds`` too. The first read finds
    the pod's id; the wait listens before each re-read, so a chunk stored meanwhile wakes
    it.
    """
    deadline = time.monotonic() + min(wait, ctx.settings.log_wait_max_seconds)
    read = partial(pods.read_logs_of, ctx, caller, ref, offset, tail, attempt)
    pod_id, out = await run_in_threadpool(read)
    if _news(out, attempt) or deadline <= time.monotonic():
        return out
    with wakeups.LOGS.listen(pod_id) as woken:
        while True:
            woken.clear()  # before the read: what is stored during it sets it again
            # the other replicas publish the pod's chunks from now on; one stored there
            # before they heard it is caught by a re-read soon after
            told = wakeups.LOGS.follow(pod_id)
            _, out = await run_in_threadpool(read)
            left = deadline - time.monotonic()
            if _news(out, attempt) or left <= 0:
                mark("server.logs.read", pod=pod_id)
                return out
            recheck = ctx.settings.log_wait_recheck_seconds
            if told:
                recheck = min(recheck, wakeups.ANNOUNCED_WITHIN)
            if await wakeups.wait(woken, min(left, recheck)):
                mark("server.logs.woken", pod=pod_id)


def _news(out: PodLogsOut, attempt: int | None) -> bool:
    """Whether a waiting read answers now: output past the offset, a pod that finished (no
    more will come), or an attempt newer than the caller's (it follows that one next)."""
    return bool(out.text) or out.finished or (attempt is not None and out.attempt != attempt)


@router.post("/{ref}/stop")
def stop_pod(ref: str, ctx: Ctx, caller: Caller,
             grace: float | None = Query(default=None, ge=0, le=3600)) -> PodOut:
    return pods.stop_pod(ctx, caller, ref, grace)


@router.post("/{ref}/start")
def start_pod(ref: str, ctx: Ctx, caller: Caller, request: Request,
              gpus: float | None = Query(default=None, ge=0, le=MAX_GPUS_PER_POD),
              migrate: bool = False) -> PodOut:
    """``gpus``: the GPU count from this start on (0: without GPUs, to reach the volume).
    ``migrate``: start on any node with room, copying the volume disk there first."""
    pod = pods.start_pod(ctx, caller, ref, gpus, migrate)
    _wake_scheduler(request)
    return pod


@router.delete("/{ref}", status_code=204)
def delete_pod(ref: str, ctx: Ctx, caller: Caller) -> Response:
    pods.delete_pod(ctx, caller, ref)
    return Response(status_code=204)
