"""/v1/agent: the node agent protocol (register, lease, assignments, status, ready, logs)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from functools import partial

from fastapi import APIRouter, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from gpucloud.api import lease_capacity, register_capacity, usage_admission
from gpucloud.api.deps import Ctx, NodeCredential, NodeId, NodeToken
from gpucloud.core.jobs import AgentPodReadyRequest
from gpucloud.core.models import (
    MAX_POLL_WAIT_SECONDS,
    AgentLogChunkRequest,
    AgentPodStatusRequest,
    AssignmentsOut,
    ErrorOut,
    LeaseRequest,
    LeaseResponse,
    NodeRegisterRequest,
    NodeRegisterResponse,
)
from gpucloud.core.phases import TERMINAL_PHASES, PodPhase
from gpucloud.core.trace import mark
from gpucloud.core.usage import AgentUsageBatchOut
from gpucloud.services import (
    agent,
    assignment_answers,
    auth_guard,
    gangs,
    lease_ttl,
    metrics,
    nodes,
    ratelimit,
    revision_watch,
    wakeups,
)
from gpucloud.services.context import ServiceContext

router = APIRouter(prefix="/v1/agent", tags=["agent"])
#: The period of the long polls' batched fallback re-read; wake-ups end a poll sooner.
POLL_SECONDS = 2.0


def _wake(request: Request) -> None:
    runner = getattr(request.app.state, "controllers", None)
    if runner is not None:
        runner.wake()


@router.post("/register", status_code=201, responses={
    401: {"model": ErrorOut, "description": "An unknown or used join token"},
    503: {"model": ErrorOut, "description": "Too many registrations under way, or this one "
                                            "waited too long in a busy server: nothing was "
                                            "done; register again after Retry-After"}})
async def register(body: NodeRegisterRequest, ctx: Ctx,
                   request: Request) -> NodeRegisterResponse:
    """A refused join token counts against the caller's address (ratelimit.py).

    On threads of its own, a few at once and a bounded queue (api/register_capacity.py):
    long polls and renewals cannot starve registrations, excess is refused at once (503 +
    Retry-After), and one that waited longer than its agent waits is refused, or rolled
    back before its commit, not done for an agent that has given it up."""
    received_at = ctx.clock.now()
    if await request.is_disconnected():
        # It waited before this route (a starved replica's accept queue and event loop,
        # which no guard here sees) past its agent's timeout: the agent gave it up and
        # sent it again, so doing it would replace the node token nobody receives.
        raise register_capacity.busy("the agent gave the registration up before its turn")
    keys = ratelimit.api_keys(request.client.host if request.client else None,
                              body.join_token)

    def work(before_commit: Callable[[], None]) -> NodeRegisterResponse:
        return auth_guard.authenticated(
            ctx, keys, partial(nodes.register_node, ctx, body, before_commit))

    response = await register_capacity.run(ctx, received_at, work)
    _wake(request)
    return response


@router.post("/lease", responses={
    503: {"model": ErrorOut, "description": "The renewal waited too long in a busy server "
                                            "(over half the TTL): not applied; send it again"}})
async def lease(body: LeaseRequest, ctx: Ctx, credential: NodeToken) -> LeaseResponse:
    """One statement while the grant is current (``nodes.renew_current``: the token
    checked inside it); the full path for a new grant, a stale token, health news.
    Renewals arriving together share one statement, on the lease's own threads
    (api/lease_capacity.py): other routes' load cannot queue in front of a renewal.
    The new expiry counts from the renewal's arrival, and one that waited here over half
    the TTL is refused (``lease_capacity.check_fresh``): nothing renews a lease late, on
    behalf of an agent that may have died meanwhile. A well-formed renewal is served by
    api/agent_fast.py, without the framework's request cycle, by ``renew`` as here."""
    return await renew(ctx, body, credential)


async def renew(ctx: ServiceContext, body: LeaseRequest,
                credential: NodeCredential) -> LeaseResponse:
    """``POST /v1/agent/lease``'s work, whichever way the request came."""
    received_at = ctx.clock.now()
    response = (await lease_capacity.renew_current(ctx, credential.token, body, received_at)
                if credential.token else None)
    if response is not None:
        credential.succeeded(ctx)  # its token passed (failures: the full path counts them)
    else:
        response = await lease_capacity.run(
            partial(_renew_full, body, credential, received_at), ctx)
    metrics.LEASES_RENEWED.inc()
    return response


def _renew_full(body: LeaseRequest, credential: NodeCredential, received_at: datetime,
                ctx: ServiceContext) -> LeaseResponse:
    lease_capacity.check_fresh(ctx, received_at)
    return nodes.renew_lease(ctx, credential.authenticate(ctx), body.fencing_token, body,
                             received_at)


@router.get("/assignments")
async def assignments(ctx: Ctx, credential: NodeToken,
                      wait: float = Query(default=0, ge=0, le=MAX_POLL_WAIT_SECONDS),
                      revision: int | None = Query(default=None)) -> AssignmentsOut:
    """Long poll: returns once the node's revision differs from ``revision``, or at ``wait``.

    One cheap query while nothing changed: the node's revision, read with its token's
    authentication (``assignment_answers.poll_state``). A change committed in this process
    wakes the poll at once (``wakeups``), and so does one committed on another replica
    (its ``LISTEN/NOTIFY`` hint, services/notify.py); the fallback for a lost hint is one
    query per process every ``POLL_SECONDS`` that reads the revisions of all waiting nodes
    at once (services/revision_watch.py), and wakes only nodes whose revision moved. A
    woken poll builds the full answer at once (returned if its revision moved, else the
    poll waits on), and a poll that ends on an unchanged revision gets the answer kept
    for it (``assignment_answers``). The first read comes before the poll listens (it
    finds the node); a change committed in that instant is caught by the watcher, which
    wakes a node whose revision moved since it last looked. Every answer asks a large
    fleet for a longer wait (``poll_wait_seconds``, services/lease_ttl.py), so that its
    polls a second stay bounded as its renewals do. A well-formed poll is served
    by api/agent_fast.py, without the framework's request cycle, by ``poll`` as here.
    """
    return await poll(ctx, credential, wait, revision)


async def poll(ctx: ServiceContext, credential: NodeCredential, wait: float,
               revision: int | None) -> AssignmentsOut:
    """``GET /v1/agent/assignments``'s work, whichever way the request came."""
    deadline = time.monotonic() + wait
    node_id, current = await run_in_threadpool(
        auth_guard.authenticated, ctx, credential.limit_keys,
        partial(assignment_answers.poll_state, ctx, credential.token))
    waited = False
    while revision is not None and current == revision and time.monotonic() < deadline:
        with wakeups.ASSIGNMENTS.listen(node_id) as woken:
            if waited:  # listening before the read: a change between them wakes us
                current = await run_in_threadpool(agent.assignments_revision, ctx, node_id)
                if current != revision:
                    break
            waited = True
            revision_watch.watcher(ctx, lambda: POLL_SECONDS).saw(node_id, current)
            if await wakeups.wait(woken, max(0.0, deadline - time.monotonic())):
                # Woken: a change was committed for this node (a bind, a stop), so the
                # answer is built at once, in one hop, not after a re-read of the revision
                # that nearly always finds it moved; a wake-up for nothing (a bind that
                # lost its race) waits on.
                mark("poll.woken")
                out = await run_in_threadpool(assignment_answers.ANSWERS.answer, ctx,
                                              node_id, None)
                mark("poll.answer.built", revision=out.revision, pods=len(out.pods))
                if out.revision != revision:
                    return _asking_wait(ctx, out)
    unchanged = current if waited and current == revision else None
    mark("poll.answering", revision=current, changed=unchanged is None)
    # the answer kept for an unchanged revision is a lookup: served here, not on a thread
    kept = (assignment_answers.ANSWERS.kept(node_id, unchanged) if unchanged is not None
            else None)
    out = kept if kept is not None else await run_in_threadpool(
        assignment_answers.ANSWERS.answer, ctx, node_id, unchanged)
    mark("poll.answer.built", revision=out.revision, pods=len(out.pods))
    return _asking_wait(ctx, out)


def _asking_wait(ctx: ServiceContext, out: AssignmentsOut) -> AssignmentsOut:
    """``out`` with the long-poll wait asked of the fleet now (``lease_ttl.poll_wait``:
    no query). A kept answer is shared, so one built at another count is copied."""
    wait = lease_ttl.poll_wait(ctx)
    return out if out.poll_wait_seconds == wait else out.model_copy(
        update={"poll_wait_seconds": wait})


@router.post("/pods/{pod_id}/status")
def pod_status(pod_id: str, body: AgentPodStatusRequest, ctx: Ctx, node_id: NodeId,
               request: Request) -> dict[str, str]:
    phase = agent.report_status(ctx, node_id, pod_id, body)
    mark("server.status.committed", pod=pod_id, phase=body.phase.value)
    if phase is PodPhase.PENDING:
        _wake(request)
    if phase in TERMINAL_PHASES:  # its log's followers wait no more: nothing will come
        wakeups.LOGS.notify(pod_id)
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
    mark("server.log.received", pod=pod_id)
    end = agent.append_log(ctx, node_id, pod_id, body)
    mark("server.log.committed", pod=pod_id, end=end)
    if body.data:  # committed: the waiting reads of the pod's log re-read it now
        wakeups.LOGS.notify(pod_id)
    return {"next_offset": end}


@router.post("/usage", response_model=AgentUsageBatchOut,
             openapi_extra=usage_admission.request_body_schema(), responses={
    409: {"model": ErrorOut, "description": "A stale fencing token, or a pod attempt that "
                                            "was never on this node: nothing is stored"},
    422: {"model": ErrorOut, "description": "A sample far in the future, or malformed"},
    503: {"model": ErrorOut, "description": "Ingest yields to API calls: nothing is "
                                            "stored; send the batch again after Retry-After"}})
async def post_usage(request: Request, ctx: Ctx,
                     node_id: NodeId) -> AgentUsageBatchOut | Response:
    """Usage samples (``AgentUsageBatchRequest``), cumulative per (pod, attempt, seq): a
    resent batch stores nothing. Deferrable work: admitted by ``api/usage_admission``
    (503 + Retry-After while API calls need the CPU), then parsed and stored on its own
    threads, never on the event loop or the request thread pool."""
    return await usage_admission.ingest(request, ctx, node_id)
