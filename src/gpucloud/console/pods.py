"""Pods: the list with its create form, a pod's page, its actions, and the live stream
(Server-Sent Events: log text and phase changes)."""

from __future__ import annotations

import asyncio
import json
import shlex
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from gpucloud.console.views import free_capacity, money
from gpucloud.console.web import ConsoleRoute, CurrentViewer, Form, Viewer, back, iso, page
from gpucloud.core.billing import UsageBy
from gpucloud.core.errors import GpucloudError
from gpucloud.core.models import PodCreateRequest, PodOut
from gpucloud.core.phases import PodPhase
from gpucloud.services import access, billing, nodes, occupancy, pods, templates

router = APIRouter(prefix="/console", route_class=ConsoleRoute, include_in_schema=False)

#: How often the stream looks for new output and phase changes.
STREAM_POLL_SECONDS = 0.5


def _wake(request: Request) -> None:
    runner = getattr(request.app.state, "controllers", None)
    if runner is not None:
        runner.wake()


def _costs(viewer: Viewer) -> dict[str, str]:
    """Pod id → its cost so far (the meter's runs of the last 30 days, priced)."""
    usage = billing.usage(viewer.ctx, viewer.principal, None, None, None, UsageBy.POD)
    return {row.pod_id: money(row.cost) for row in usage.rows if row.pod_id}


def _listed(viewer: Viewer) -> list[PodOut]:
    """The project's own pods (a job's members are on its page)."""
    return [p for p in pods.list_pods(viewer.ctx, viewer.principal) if p.job_id is None]


@router.get("/pods")
def pod_list(request: Request, viewer: CurrentViewer) -> Response:
    ctx, caller = viewer.ctx, viewer.principal
    listed = _listed(viewer)
    capacity = free_capacity(nodes.list_nodes(ctx), occupancy.gpu_occupancy(ctx, caller))
    return page(request, "pods.html", viewer, pods=listed, costs=_costs(viewer),
                templates=templates.list_templates(ctx, caller), capacity=capacity,
                max_gpus=max(capacity.values(), default=0))


@router.get("/pods/_rows")
def pod_rows(request: Request, viewer: CurrentViewer) -> Response:
    """The list's rows alone: what the pods page fetches now and then while it is visible
    (``_`` cannot start a pod's name, so this never shadows a pod)."""
    return page(request, "pod_rows.html", viewer, pods=_listed(viewer), costs=_costs(viewer))


def create_request(form: dict[str, str]) -> PodCreateRequest:
    """The create form as the API's request: only the fields filled in are set, so that a
    template's values stay where the form leaves them empty."""
    body: dict[str, Any] = {"name": form.get("name", "").strip()}
    for name in ("template", "image", "gpu_type"):
        if form.get(name, "").strip():
            body[name] = form[name].strip()
    if form.get("gpus", "").strip():
        body["gpus"] = form["gpus"].strip()
    if form.get("command", "").strip():
        body["command"] = shlex.split(form["command"])
    if form.get("ports", "").strip():
        body["ports"] = [p.strip() for p in form["ports"].split(",") if p.strip()]
    return PodCreateRequest.model_validate(body)


@router.post("/pods")
def pod_create(request: Request, viewer: CurrentViewer, form: Form) -> Response:
    pod = pods.create_pod(viewer.ctx, viewer.principal, create_request(form))
    _wake(request)
    return back(f"/console/pods/{pod.id}")


def _http_links(request: Request, viewer: Viewer, pod: PodOut) -> dict[str, str]:
    points = access.AccessPoints(host=request.url.hostname or "127.0.0.1",
                                 api_port=request.url.port,
                                 ssh_port=getattr(request.app.state, "ssh_port", None))
    info = access.pod_access(viewer.ctx, viewer.principal.project_id, pod.id, points)
    token = f"?gpucloud_token={info.proxy_token}" if info.proxy_token else ""
    return {port: url + token for port, url in info.http.items()}


@router.get("/pods/{ref}")
def pod_page(ref: str, request: Request, viewer: CurrentViewer) -> Response:
    ctx, caller = viewer.ctx, viewer.principal
    pod = pods.get_pod(ctx, caller, ref)
    why = pods.why_pod(ctx, caller, pod.id) if pod.phase is PodPhase.PENDING else None
    return page(request, "pod.html", viewer, pod=pod, why=why,
                events=pods.list_events(ctx, caller, pod.id),
                links=_http_links(request, viewer, pod), cost=_costs(viewer).get(pod.id))


@router.post("/pods/{ref}/stop")
def pod_stop(ref: str, viewer: CurrentViewer, _form: Form) -> Response:
    pod = pods.stop_pod(viewer.ctx, viewer.principal, ref)
    return back(f"/console/pods/{pod.id}")


@router.post("/pods/{ref}/start")
def pod_start(ref: str, request: Request, viewer: CurrentViewer, _form: Form) -> Response:
    pod = pods.start_pod(viewer.ctx, viewer.principal, ref)
    _wake(request)
    return back(f"/console/pods/{pod.id}")


@router.post("/pods/{ref}/delete")
def pod_delete(ref: str, viewer: CurrentViewer, _form: Form) -> Response:
    pods.delete_pod(viewer.ctx, viewer.principal, ref)
    return back("/console/pods")


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


async def _stream(request: Request, viewer: Viewer, pod_id: str) -> AsyncIterator[str]:
    """Log text as it arrives and each new phase, until the client goes away."""
    ctx, caller = viewer.ctx, viewer.principal
    offset, attempt, phase = 0, None, None
    while not await request.is_disconnected():
        try:
            logs = await run_in_threadpool(pods.read_logs, ctx, caller, pod_id, offset, None,
                                           attempt)
            pod = await run_in_threadpool(pods.get_pod, ctx, caller, pod_id)
        except GpucloudError as error:  # deleted meanwhile
            yield _event("gone", {"message": error.message})
            return
        if logs.text:
            yield _event("log", {"text": logs.text, "attempt": logs.attempt})
        offset, attempt = logs.next_offset, logs.attempt
        if pod.phase != phase:
            phase = pod.phase
            yield _event("phase", {"phase": pod.phase.value, "reason": pod.reason or "",
                                   "node": pod.node or "", "started_at": iso(pod.started_at)})
        await asyncio.sleep(STREAM_POLL_SECONDS)


@router.get("/pods/{ref}/stream")
def pod_stream(ref: str, request: Request, viewer: CurrentViewer) -> Response:
    pod = pods.get_pod(viewer.ctx, viewer.principal, ref)  # 404 before the stream starts
    return StreamingResponse(_stream(request, viewer, pod.id), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
