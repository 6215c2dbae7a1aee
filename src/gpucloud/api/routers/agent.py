"""/v1/agent: the node agent protocol (register, lease, assignments, status, ready, logs)."""

from __future__ import annotations

import time
from functools import partial

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool

from gpucloud.api.deps import Ctx, NodeId
from gpucloud.core.jobs import AgentPodReadyRequest
from gpucloud.core.models import (
    AgentLogChunkRequest,
    AgentPodStatusRequest,
    AssignmentsOut,
    ErrorOut,
    LeaseRequest,
    LeaseResponse,
    NodeRegisterRequest,
    NodeRegisterResponse,
)
from gpucloud.core.phases import PodPhase
from gpucloud.core.usage import AgentUsageBatchOut, AgentUsageBatchRequest
from gpucloud.services import (
    agent,
    auth_guard,
    gangs,
    metrics,
    nodes,
    ratelimit,
    usage,
    wakeups,
)

router = APIRouter(prefix="/v1/agent", tags=["agent"])
POLL_SECONDS = 0.25


def _wake(request: Request) -> None:
    runner = getattr(request.app.state, "controllers", None)
    if runner is not None:
        runner.wake()


@router.post("/register", status_code=201,
             responses={401: {"model": ErrorOut, "description": "An unknown or used join token"}})
def register(body: NodeRegisterRequest, ctx: Ctx, request: Request) -> NodeRegisterResponse:
    """A refused join token counts against the caller's address (ratelimit.py)."""
    keys = ratelimit.api_keys(request.client.host if request.client else None,
                              body.join_token)
    response = auth_guard.authenticated(ctx, keys, partial(nodes.register_node, ctx, body))
    _wake(request)
    return response


@router.post("/lease")
def lease(body: LeaseRequest, ctx: Ctx, node_id: NodeId) -> LeaseResponse:
    response = nodes.renew_lease(ctx, node_id, body.fencing_token)
    metrics.LEASES_RENEWED.inc()
    return response


@router.get("/assignments")
async def assignments(ctx: Ctx, node_id: NodeId,
                      wait: float = Query(default=0, ge=0, le=60),
                      revision: int | None = Query(default=None)) -> AssignmentsOut:
    """Long poll: returns once the node's revision differs from ``revision``, or at ``wait``.

    A change committed in this process wakes the poll at once (``wakeups``); the revision,
    a single integer column re-read every ``POLL_SECONDS`` (one cheap query), carries
    changes made by other server replicas.
    """
    deadline = time.monotonic() + wait
    while revision is not None and time.monotonic() < deadline:
        with wakeups.ASSIGNMENTS.listen(node_id) as woken:
            current = await run_in_threadpool(agent.assignments_revision, ctx, node_id)
            if current != revision:
                break
            await wakeups.wait(woken, min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))
    return await run_in_threadpool(agent.assignments, ctx, node_id)


@router.post("/pods/{pod_id}/status")
def pod_status(pod_id: str, body: AgentPodStatusRequest, ctx: Ctx, node_id: NodeId,
               request: Request) -> dict[str, str]:
    phase = agent.report_status(ctx, node_id, pod_id, body)
    if phase is PodPhase.PENDING:
        _wake(request)
    return {"phase": phase.value}


@router.post("/pods/{pod_id}/ready")
def pod_ready(pod_id: str, body: AgentPodReadyRequest, ctx: Ctx, node_id: NodeId,
              request: Request) -> dict[str, bool]:
    """A job member waits at the start barrier; the controller releases the gang."""
    gangs.report_ready(ctx, node_id, pod_id, body)
    _wake(request)
    return {"ready": True}


@router.post("/pods/{pod_id}/logs")
def pod_logs(pod_id: str, body: AgentLogChunkRequest, ctx: Ctx,
             node_id: NodeId) -> dict[str, int]:
    return {"next_offset": agent.append_log(ctx, node_id, pod_id, body)}


@router.post("/usage", responses={
    409: {"model": ErrorOut, "description": "A stale fencing token, or a pod attempt that "
                                            "was never on this node: nothing is stored"},
    422: {"model": ErrorOut, "description": "A sample far in the future, or malformed"}})
def post_usage(body: AgentUsageBatchRequest, ctx: Ctx, node_id: NodeId) -> AgentUsageBatchOut:
    """Usage samples, cumulative per (pod, attempt, seq): a resent batch stores nothing."""
    return usage.ingest(ctx, node_id, body)
