"""/v1/pods: pods of the caller's project."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response

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
from gpucloud.services import pods

router = APIRouter(prefix="/v1/pods", tags=["pods"])


def _wake_scheduler(request: Request) -> None:
    runner = getattr(request.app.state, "controllers", None)
    if runner is not None:
        runner.wake()


@router.post("", status_code=201, response_model=PodOut)
def create_pod(body: PodCreateRequest, ctx: Ctx, caller: Caller, request: Request) -> Response:
    pod = pods.create_pod(ctx, caller, body)
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
def pod_logs(ref: str, ctx: Ctx, caller: Caller, offset: int = Query(default=0, ge=0),
             tail: int | None = Query(default=None, ge=0),
             attempt: int | None = Query(default=None, ge=0)) -> PodLogsOut:
    return pods.read_logs(ctx, caller, ref, offset, tail, attempt)


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
