"""The durable request queue of serverless endpoints (``endpoint_requests``).

A request is submitted ``IN_QUEUE``; a worker takes it under a lease (``IN_PROGRESS``,
``worker_pod_id``, ``lease_expires_at``) with a guarded UPDATE (``status`` and
``version`` in the WHERE: 0 rows means another worker got it), the same statement on
PostgreSQL and SQLite; pings and progress renew the lease. A lapsed lease (the worker
died) puts the request back ``IN_QUEUE`` with ``retries`` + 1 until ``max_retries``,
then ``FAILED``; past its execution timeout it is ``TIMED_OUT``. A cancelled or timed-out
request whose worker has not yet been told keeps ``lease_expires_at`` set: the worker's
``job-stop`` poll returns it once and clears it. Finished rows are kept until
``expires_at`` (1 min after ``runsync``, 30 min after ``run``), their webhook POSTed
with retries.

Long polls wait on in-process wake-ups (``WAKEUPS``: ``q:<endpoint>`` on submit,
``r:<request>`` when one finishes, ``stop:<pod>`` on cancel) and re-read the database
every ``POLL_FALLBACK_SECONDS`` (a change made by another replica).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import httpx
from sqlalchemy import delete, exists, func, or_, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from gpucloud.core.egress import EgressPolicy, EgressRefused, Target
from gpucloud.core.errors import InvalidInput, NotFound
from gpucloud.core.phases import PodPhase
from gpucloud.core.serverless import RequestStatus
from gpucloud.db.models import EndpointModel, EndpointRequestModel, PodModel
from gpucloud.services.context import ServiceContext, new_id
from gpucloud.services.events import record_event
from gpucloud.services.pods import bump_assignments
from gpucloud.services.projects import Principal
from gpucloud.services.wakeups import Wakeups

log = logging.getLogger(__name__)

LEASE_SECONDS = 30.0
SYNC_RETENTION_SECONDS = 60.0
ASYNC_RETENTION_SECONDS = 30 * 60.0
POLL_FALLBACK_SECONDS = 1.0
MAX_BATCH = 64
EXPIRE_LIMIT = 200
WEBHOOK_ATTEMPTS = 3
WEBHOOK_BACKOFF_SECONDS = 10.0
MAX_INPUT_BYTES = 10 * 1024**2
#: Pods that will never report a result again: their requests go back to the queue.
_GONE_PHASES = (PodPhase.FAILED.value, PodPhase.STOPPED.value, PodPhase.SUCCEEDED.value,
                PodPhase.LOST.value)
_LIVE = (RequestStatus.IN_QUEUE.value, RequestStatus.IN_PROGRESS.value)
_Q = EndpointRequestModel

WAKEUPS = Wakeups()


@dataclass
class QueueStats:
    """One endpoint's queue as the autoscaler reads it."""

    in_queue: int = 0
    in_progress: int = 0
    oldest_queued_at: datetime | None = None
    #: Worker pod id -> requests it runs now.
    in_flight: dict[str, int] = field(default_factory=dict)


# --- lookups -----------------------------------------------------------------------


def find_endpoint(session: Session, project_id: str, ref: str) -> EndpointModel | None:
    """A live endpoint of the project by id or name."""
    return session.scalar(select(EndpointModel).where(
        EndpointModel.project_id == project_id, EndpointModel.deleted_at.is_(None),
        (EndpointModel.id == ref) | (EndpointModel.name == ref)))


def get_endpoint_row(session: Session, caller: Principal, ref: str) -> EndpointModel:
    endpoint = find_endpoint(session, caller.project_id, ref)
    if endpoint is None:
        raise NotFound(f"endpoint {ref!r} not found")
    return endpoint


def _request(session: Session, endpoint: EndpointModel, request_id: str) -> _Q:
    row = session.scalar(select(_Q).where(_Q.id == request_id,
                                          _Q.endpoint_id == endpoint.id))
    if row is None:
        raise NotFound(f"request {request_id!r} not found")
    return row


def _rowcount(result: Any) -> int:
    assert isinstance(result, CursorResult)
    return int(result.rowcount)


# --- the client side ---------------------------------------------------------------


def _ms_policy(policy: Any, key: str) -> float | None:
    """``policy.executionTimeout`` / ``policy.ttl`` in ms, as seconds."""
    value = policy.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and 1000 <= value <= 7 * 86400 * 1000):
        raise InvalidInput(f"policy.{key}", "must be milliseconds from 1000 to 604800000")
    return float(value) / 1000


def _parse_body(body: Any, egress: EgressPolicy
                ) -> tuple[Any, str | None, float | None, float | None]:
    """RunPod's ``{"input": …, "webhook"?: url, "policy"?: {executionTimeout, ttl}}``."""
    if not isinstance(body, dict) or "input" not in body:
        raise InvalidInput("input", "field required: the request's input")
    if len(json.dumps(body["input"])) > MAX_INPUT_BYTES:
        raise InvalidInput("input", "must be at most 10 MiB of JSON")
    webhook = body.get("webhook")
    if webhook is not None and (not isinstance(webhook, str) or len(webhook) > 2048
                                or not webhook.startswith(("http://", "https://"))):
        raise InvalidInput("webhook", "must be an http:// or https:// URL")
    if webhook is not None:
        try:
            egress.check_literal(webhook)
        except EgressRefused as refused:
            raise InvalidInput("webhook", str(refused)) from None
    policy = body.get("policy")
    policy = {} if policy is None else policy
    if not isinstance(policy, dict):
        raise InvalidInput("policy", "must be an object")
    return body["input"], webhook, _ms_policy(policy, "executionTimeout"), _ms_policy(
        policy, "ttl")


def submit(ctx: ServiceContext, caller: Principal, endpoint_ref: str, body: Any,
           sync: bool) -> dict[str, Any]:
    """Queue one request; returns ``{"id", "status"}``."""
    job_input, webhook, timeout, ttl = _parse_body(body, ctx.settings.webhook_egress)
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        endpoint = get_endpoint_row(session, caller, endpoint_ref)
        row = _Q(id=new_id(), endpoint_id=endpoint.id, project_id=endpoint.project_id,
                 status=RequestStatus.IN_QUEUE.value, input=job_input, sync=sync,
                 execution_timeout_seconds=timeout, webhook=webhook, created_at=now,
                 expires_at=None if ttl is None else now + timedelta(seconds=ttl),
                 retries=0, version=0)
        session.add(row)
        endpoint_id = endpoint.id
    WAKEUPS.notify(f"q:{endpoint_id}")
    return {"id": row.id, "status": RequestStatus.IN_QUEUE.value}


def _ms(start: datetime | None, end: datetime | None) -> int | None:
    if start is None or end is None:
        return None
    return max(0, round((end - start).total_seconds() * 1000))


def render(row: _Q) -> dict[str, Any]:
    """A request as RunPod's ``/status`` shows it (and webhooks POST it)."""
    out: dict[str, Any] = {"id": row.id, "status": row.status}
    delay = _ms(row.created_at, row.started_at)
    if delay is not None:
        out["delayTime"] = delay
    execution = _ms(row.started_at, row.finished_at)
    if execution is not None:
        out["executionTime"] = execution
    if row.output is not None:
        out["output"] = row.output
    if row.error is not None:
        out["error"] = row.error
    if row.retries:
        out["retries"] = row.retries
    if row.worker_pod_id is not None:
        out["workerId"] = row.worker_pod_id
    return out


def endpoint_id_of(ctx: ServiceContext, caller: Principal, endpoint_ref: str) -> str:
    with ctx.db.read() as session:
        return get_endpoint_row(session, caller, endpoint_ref).id


def status(ctx: ServiceContext, caller: Principal, endpoint_ref: str,
           request_id: str) -> dict[str, Any]:
    with ctx.db.read() as session:
        endpoint = get_endpoint_row(session, caller, endpoint_ref)
        return render(_request(session, endpoint, request_id))


def stream(ctx: ServiceContext, caller: Principal, endpoint_ref: str,
           request_id: str) -> dict[str, Any]:
    """The stream chunks posted since the last ``/stream`` call (each returned once, as
    RunPod does); always has a ``stream`` key."""
    for _ in range(5):
        with ctx.db.transaction() as session:
            endpoint = get_endpoint_row(session, caller, endpoint_ref)
            row = _request(session, endpoint, request_id)
            chunks = list(row.stream or [])
            out = {**render(row), "stream": chunks}
            if not chunks:
                return out
            taken = session.execute(update(_Q).where(_Q.id == row.id,
                                                     _Q.version == row.version)
                                    .values(stream=[], version=row.version + 1))
            if _rowcount(taken):
                return out
    return {**out, "stream": []}


def cancel(ctx: ServiceContext, caller: Principal, endpoint_ref: str,
           request_id: str) -> dict[str, Any]:
    """Cancel a queued or running request (its worker is told through job-stop); a
    finished one keeps its status."""
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        endpoint = get_endpoint_row(session, caller, endpoint_ref)
        row = _request(session, endpoint, request_id)
        worker = row.worker_pod_id if row.status == RequestStatus.IN_PROGRESS else None
        if row.status in _LIVE:
            _finish_row(row, now, RequestStatus.CANCELLED, keep_stop_marker=worker is not None)
        out = {"id": row.id, "status": row.status}
    _wake_finished(request_id, worker)
    return out


def _finish_row(row: _Q, now: datetime, final: RequestStatus, *,
                keep_stop_marker: bool = False) -> None:
    """Mark a row final in the caller's transaction (its webhook becomes due)."""
    row.status = final.value
    row.finished_at = now
    retention = SYNC_RETENTION_SECONDS if row.sync else ASYNC_RETENTION_SECONDS
    row.expires_at = now + timedelta(seconds=retention)
    row.lease_expires_at = row.lease_expires_at if keep_stop_marker else None
    if row.webhook:
        row.webhook_state, row.webhook_next_at = "pending", now
    row.version += 1


def _wake_finished(request_id: str, worker: str | None) -> None:
    WAKEUPS.notify(f"r:{request_id}")
    if worker is not None:
        WAKEUPS.notify(f"stop:{worker}")


def purge(ctx: ServiceContext, caller: Principal, endpoint_ref: str) -> int:
    """Cancel every queued request (not the running ones); returns how many."""
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        endpoint = get_endpoint_row(session, caller, endpoint_ref)
        rows = session.scalars(select(_Q).where(
            _Q.endpoint_id == endpoint.id, _Q.status == RequestStatus.IN_QUEUE.value)).all()
        for row in rows:
            _finish_row(row, now, RequestStatus.CANCELLED)
        ids = [row.id for row in rows]
    for request_id in ids:
        WAKEUPS.notify(f"r:{request_id}")
    return len(ids)


def cancel_all(session: Session, endpoint_id: str, now: datetime) -> list[str]:
    """Cancel every live request of an endpoint (it is being deleted), in the caller's
    transaction; returns their ids."""
    rows = session.scalars(select(_Q).where(_Q.endpoint_id == endpoint_id,
                                            _Q.status.in_(_LIVE))).all()
    for row in rows:
        _finish_row(row, now, RequestStatus.CANCELLED)
    return [row.id for row in rows]


def health(ctx: ServiceContext, caller: Principal, endpoint_ref: str) -> dict[str, Any]:
    """RunPod's ``/health``: request counts by status (of the requests kept) and workers."""
    with ctx.db.read() as session:
        endpoint = get_endpoint_row(session, caller, endpoint_ref)
        counts = dict(session.execute(select(_Q.status, func.count()).where(
            _Q.endpoint_id == endpoint.id).group_by(_Q.status)).all())
        retried = session.scalar(select(func.count()).where(
            _Q.endpoint_id == endpoint.id, _Q.retries > 0)) or 0
        running, idle = worker_counts(session, endpoint.id)
    return {
        "jobs": {"completed": counts.get("COMPLETED", 0),
                 "failed": counts.get("FAILED", 0) + counts.get("TIMED_OUT", 0),
                 "inProgress": counts.get("IN_PROGRESS", 0),
                 "inQueue": counts.get("IN_QUEUE", 0), "retried": int(retried)},
        "workers": {"idle": idle, "running": running},
    }


def worker_counts(session: Session, endpoint_id: str) -> tuple[int, int]:
    """The endpoint's worker pods running now, and those of them with nothing in flight."""
    running = set(session.scalars(select(PodModel.id).where(
        PodModel.endpoint_id == endpoint_id, PodModel.deleted_at.is_(None),
        PodModel.phase == PodPhase.RUNNING.value)))
    busy = set(session.scalars(select(_Q.worker_pod_id).where(
        _Q.endpoint_id == endpoint_id, _Q.status == RequestStatus.IN_PROGRESS.value)))
    return len(running), len(running - busy)


def wait_seconds(ctx: ServiceContext, caller: Principal, endpoint_ref: str,
                 request_id: str) -> bool:
    """Whether the request is final (``runsync``'s check between wake-ups)."""
    return RequestStatus(status(ctx, caller, endpoint_ref, request_id)["status"]).final


# --- the worker side ---------------------------------------------------------------


def take(ctx: ServiceContext, endpoint_id: str, worker_pod_id: str,
         batch_size: int = 1) -> list[dict[str, Any]]:
    """Lease up to ``batch_size`` of the oldest queued requests to the worker; each row
    goes to one worker only (the guarded UPDATE). Returns ``{"id", "input"}`` jobs. A
    worker that lost every race for the rows it saw looks again (a few times)."""
    batch_size = max(1, min(batch_size, MAX_BATCH))
    for _ in range(3):
        jobs, contended = _take_once(ctx, endpoint_id, worker_pod_id, batch_size)
        if jobs or not contended:
            return jobs
    return []


def _take_once(ctx: ServiceContext, endpoint_id: str, worker_pod_id: str,
               batch_size: int) -> tuple[list[dict[str, Any]], bool]:
    """One try: the jobs leased, and whether queued rows were seen but all lost."""
    now = ctx.clock.now()
    lease = now + timedelta(seconds=LEASE_SECONDS)
    jobs: list[dict[str, Any]] = []
    with ctx.db.transaction() as session:
        if not session.scalar(select(func.count()).where(
                PodModel.id == worker_pod_id, PodModel.deleted_at.is_(None),
                PodModel.desired_state == "running")):
            return [], False  # a worker being stopped takes nothing more
        candidates = session.execute(select(_Q.id, _Q.version, _Q.input).where(
            _Q.endpoint_id == endpoint_id, _Q.status == RequestStatus.IN_QUEUE.value)
            .order_by(_Q.created_at, _Q.id).limit(batch_size * 2)).all()
        for request_id, version, job_input in candidates:
            taken = session.execute(update(_Q).where(
                _Q.id == request_id, _Q.version == version,
                _Q.status == RequestStatus.IN_QUEUE.value).values(
                status=RequestStatus.IN_PROGRESS.value, worker_pod_id=worker_pod_id,
                lease_expires_at=lease, started_at=now, version=version + 1))
            if _rowcount(taken):
                jobs.append({"id": request_id, "input": job_input})
                if len(jobs) == batch_size:
                    break
        if jobs:
            session.execute(update(PodModel).where(PodModel.id == worker_pod_id)
                            .values(worker_idle_since=None))
    return jobs, bool(candidates) and not jobs


def renew(ctx: ServiceContext, worker_pod_id: str, request_ids: list[str]) -> int:
    """A worker's ping names the requests it runs: extend their leases. One of them that
    was cancelled or timed out meanwhile is still running there (the SDK drops a stop
    that arrives before the job's task starts): its stop is sent again."""
    if not request_ids:
        return 0
    now = ctx.clock.now()
    lease = now + timedelta(seconds=LEASE_SECONDS)
    with ctx.db.transaction() as session:
        renewed = _rowcount(session.execute(update(_Q).where(
            _Q.id.in_(request_ids), _Q.worker_pod_id == worker_pod_id,
            _Q.status == RequestStatus.IN_PROGRESS.value).values(lease_expires_at=lease)))
        rearmed = _rowcount(session.execute(update(_Q).where(
            _Q.id.in_(request_ids), _Q.worker_pod_id == worker_pod_id,
            _Q.lease_expires_at.is_(None),
            _Q.status.in_((RequestStatus.CANCELLED.value, RequestStatus.TIMED_OUT.value)))
            .values(lease_expires_at=now)))
    if rearmed:
        WAKEUPS.notify(f"stop:{worker_pod_id}")
    return renewed


def progress(ctx: ServiceContext, worker_pod_id: str, request_id: str, output: Any) -> bool:
    """A progress update (``"status": "IN_PROGRESS"``): shown as the output, renews."""
    lease = ctx.clock.now() + timedelta(seconds=LEASE_SECONDS)
    with ctx.db.transaction() as session:
        return bool(_rowcount(session.execute(update(_Q).where(
            _Q.id == request_id, _Q.worker_pod_id == worker_pod_id,
            _Q.status == RequestStatus.IN_PROGRESS.value).values(
            output=output, lease_expires_at=lease))))


def add_stream_chunks(ctx: ServiceContext, worker_pod_id: str, request_id: str,
                      chunks: list[Any]) -> bool:
    """Append stream chunks (``{"output": …}`` each) to a request the worker runs."""
    lease = ctx.clock.now() + timedelta(seconds=LEASE_SECONDS)
    for _ in range(10):
        with ctx.db.transaction() as session:
            row = session.execute(select(_Q.version, _Q.stream).where(
                _Q.id == request_id, _Q.worker_pod_id == worker_pod_id,
                _Q.status == RequestStatus.IN_PROGRESS.value)).first()
            if row is None:
                return False
            version, existing = row
            stored = session.execute(update(_Q).where(
                _Q.id == request_id, _Q.version == version).values(
                stream=[*(existing or []), *chunks], lease_expires_at=lease,
                version=version + 1))
            if _rowcount(stored):
                return True
    return False


def finish(ctx: ServiceContext, worker_pod_id: str, request_id: str, result: dict[str, Any],
           stream_done: bool = False) -> bool:
    """The worker's result: ``{"output"}`` (COMPLETED) or with ``"error"`` (FAILED). Only
    the worker holding the request may finish it; a late result (cancelled, timed out,
    re-leased) is dropped. The worker is idle from now when nothing else is in flight."""
    now = ctx.clock.now()
    error = result.get("error")
    with ctx.db.transaction() as session:
        row = session.scalar(select(_Q).where(
            _Q.id == request_id, _Q.worker_pod_id == worker_pod_id,
            _Q.status == RequestStatus.IN_PROGRESS.value))
        if row is None:
            return False
        row.output = result.get("output")
        row.error = None if error is None else (error if isinstance(error, str)
                                                else json.dumps(error))
        row.stream_done = row.stream_done or stream_done
        _finish_row(row, now, RequestStatus.FAILED if error else RequestStatus.COMPLETED)
        session.flush()
        _mark_idle_if_free(session, worker_pod_id, now)
        if result.get("stopPod") is True:
            _refresh_worker(session, worker_pod_id, now)
    WAKEUPS.notify(f"r:{request_id}")
    return True


def _refresh_worker(session: Session, worker_pod_id: str, now: datetime) -> None:
    """RunPod's ``stopPod`` (a handler that returned ``refresh_worker``): the worker takes
    nothing more and is stopped; the autoscaler then replaces it with a fresh one."""
    pod = session.get(PodModel, worker_pod_id)
    if pod is None or pod.desired_state != "running":
        return
    pod.desired_state = "stopped"
    pod.version += 1
    record_event(session, pod.id, now, "WorkerRefresh",
                 "the worker asked to be refreshed after its job (stopPod): stopped, and "
                 "replaced by the autoscaler")
    bump_assignments(session, pod.node_id)


def _mark_idle_if_free(session: Session, worker_pod_id: str, now: datetime) -> None:
    busy = session.scalar(select(func.count()).where(
        _Q.worker_pod_id == worker_pod_id, _Q.status == RequestStatus.IN_PROGRESS.value))
    if not busy:
        session.execute(update(PodModel).where(PodModel.id == worker_pod_id)
                        .values(worker_idle_since=now))


def stop_signals(ctx: ServiceContext, worker_pod_id: str) -> list[str]:
    """Requests the worker runs that were cancelled or timed out, each returned once."""
    with ctx.db.transaction() as session:
        rows = session.execute(select(_Q.id, _Q.version).where(
            _Q.worker_pod_id == worker_pod_id, _Q.lease_expires_at.is_not(None),
            _Q.status.in_((RequestStatus.CANCELLED.value,
                           RequestStatus.TIMED_OUT.value)))).all()
        told = []
        for request_id, version in rows:
            cleared = session.execute(update(_Q).where(
                _Q.id == request_id, _Q.version == version).values(
                lease_expires_at=None, version=version + 1))
            if _rowcount(cleared):
                told.append(request_id)
        if told:
            _mark_idle_if_free(session, worker_pod_id, ctx.clock.now())
    return told


def worker_unhealthy(ctx: ServiceContext, worker_pod_id: str) -> int:
    """The worker reported itself unhealthy and exits: its requests' leases lapse now."""
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        return _rowcount(session.execute(update(_Q).where(
            _Q.worker_pod_id == worker_pod_id,
            _Q.status == RequestStatus.IN_PROGRESS.value).values(lease_expires_at=now)))


#: Whether the autoscaler's pass has anything to look at: a live endpoint (to size) or a
#: request row (to expire, time out, retry or drop, its webhook to deliver). Built once:
#: every controller pass asks, and most clouds serve no endpoint.
_ANY_WORK = select(or_(exists(select(EndpointModel.id).where(EndpointModel.deleted_at.is_(None))),
                       exists(select(_Q.id))))


def has_work(ctx: ServiceContext) -> bool:
    """Whether ``expire``, ``autoscale`` or ``deliver_webhooks`` may have something to do
    (one read; without it they cost a fenced write transaction and five queries)."""
    with ctx.db.read() as session:
        return bool(session.connection().execute(_ANY_WORK).scalar())


def queue_stats(ctx: ServiceContext) -> dict[str, QueueStats]:
    """Every live endpoint's queue (zeros when empty): what the autoscaler sizes from."""
    with ctx.db.read() as session:
        stats = {endpoint_id: QueueStats() for endpoint_id in session.scalars(
            select(EndpointModel.id).where(EndpointModel.deleted_at.is_(None)))}
        for endpoint_id, state, count, oldest in session.execute(select(
                _Q.endpoint_id, _Q.status, func.count(), func.min(_Q.created_at))
                .where(_Q.status.in_(_LIVE)).group_by(_Q.endpoint_id, _Q.status)):
            entry = stats.get(endpoint_id)
            if entry is None:
                continue
            if state == RequestStatus.IN_QUEUE.value:
                entry.in_queue, entry.oldest_queued_at = int(count), _utc(oldest)
            else:
                entry.in_progress = int(count)
        for endpoint_id, pod_id, count in session.execute(select(
                _Q.endpoint_id, _Q.worker_pod_id, func.count()).where(
                _Q.status == RequestStatus.IN_PROGRESS.value, _Q.worker_pod_id.is_not(None))
                .group_by(_Q.endpoint_id, _Q.worker_pod_id)):
            if endpoint_id in stats and pod_id is not None:
                stats[endpoint_id].in_flight[pod_id] = int(count)
    return stats


def _utc(value: datetime | None) -> datetime | None:
    """``MIN(created_at)`` keeps the column's type (UTC-aware); a naive value is UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


# --- controller passes -------------------------------------------------------------


def expire(ctx: ServiceContext) -> int:
    """One bounded pass: requeue (or fail) requests whose worker's lease lapsed or whose
    worker is gone, time out those past their execution timeout, drop queued ones past
    their ``policy.ttl`` and finished ones past retention. Returns the rows changed."""
    now = ctx.clock.now()
    changed, woken = 0, []
    with ctx.db.transaction() as session:
        for row, max_retries, timeout, gone in _in_progress(session, now):
            if row.started_at is not None and now >= row.started_at + timedelta(
                    seconds=row.execution_timeout_seconds or timeout):
                row.error = f"execution timeout ({row.execution_timeout_seconds or timeout:g}s)"
                _finish_row(row, now, RequestStatus.TIMED_OUT, keep_stop_marker=not gone)
                woken.append((row.id, None if gone else row.worker_pod_id))
            elif gone or (row.lease_expires_at is not None and row.lease_expires_at <= now):
                _requeue(row, now, max_retries)
                woken.append((row.id, None))
            else:
                continue
            changed += 1
        changed += _drop_expired(session, now)
    for request_id, worker in woken:
        _wake_finished(request_id, worker)
    return changed


def _in_progress(session: Session, now: datetime) -> list[tuple[_Q, int, float, bool]]:
    """Running requests that may need attention, with the endpoint's retries and timeout
    and whether the worker is gone: those whose lease lapsed or worker is gone, then the
    longest-running ones (the candidates for a timeout), each bounded."""
    gone = (PodModel.id.is_(None) | PodModel.deleted_at.is_not(None)
            | PodModel.phase.in_(_GONE_PHASES))
    base = (select(_Q, EndpointModel.max_retries, EndpointModel.execution_timeout_seconds,
                   gone)
            .join(EndpointModel, EndpointModel.id == _Q.endpoint_id)
            .outerjoin(PodModel, PodModel.id == _Q.worker_pod_id)
            .where(_Q.status == RequestStatus.IN_PROGRESS.value))
    lapsed = session.execute(base.where(gone | (_Q.lease_expires_at <= now))
                             .limit(EXPIRE_LIMIT)).all()
    oldest = session.execute(base.order_by(_Q.started_at).limit(EXPIRE_LIMIT)).all()
    seen: dict[str, tuple[_Q, int, float, bool]] = {}
    for row, retries, timeout, lost in [*lapsed, *oldest]:
        seen.setdefault(row.id, (row, int(retries), float(timeout), bool(lost)))
    return list(seen.values())


def _requeue(row: _Q, now: datetime, max_retries: int) -> None:
    """Back to the queue with one more retry, or FAILED once past ``max_retries``."""
    row.worker_pod_id, row.lease_expires_at = None, None
    if row.retries >= max_retries:
        row.error = f"the worker was lost {row.retries + 1} times (max retries {max_retries})"
        _finish_row(row, now, RequestStatus.FAILED)
        return
    row.retries += 1
    row.status, row.started_at, row.stream = RequestStatus.IN_QUEUE.value, None, None
    row.version += 1


def _drop_expired(session: Session, now: datetime) -> int:
    """Delete finished rows past retention and queued ones past their ttl (bounded)."""
    ids = list(session.scalars(select(_Q.id).where(
        _Q.expires_at <= now, _Q.status != RequestStatus.IN_PROGRESS.value,
        (_Q.webhook_state.is_(None)) | (_Q.webhook_state != "pending"))
        .limit(EXPIRE_LIMIT)))
    if not ids:
        return 0
    return _rowcount(session.execute(delete(_Q).where(_Q.id.in_(ids))))


def http_post(target: Target, body: bytes) -> int:
    """POST a webhook to a checked address (5 s timeout, no redirects followed: a
    redirect could lead anywhere); the status, or 0 when it could not be delivered."""
    headers = {"Content-Type": "application/json", "Host": urlsplit(target.url).netloc}
    with httpx.Client(timeout=5.0) as client:
        for address in target.addresses:  # the next one only when this one cannot connect
            request = client.build_request("POST", target.pinned_url(address), content=body,
                                           headers=headers,
                                           extensions={"sni_hostname": target.host})
            try:
                return client.send(request).status_code
            except httpx.ConnectError:
                continue
            except httpx.HTTPError:
                return 0
    return 0


def _post_checked(ctx: ServiceContext, post: Callable[[Target, bytes], int], url: str,
                  body: bytes) -> int | None:
    """The delivery's status; None when the egress policy refuses the destination (then
    it is not retried: a refused address stays refused)."""
    try:
        target = ctx.settings.webhook_egress.resolve(url)
    except EgressRefused as refused:
        log.warning("webhook to %s refused: %s", urlsplit(url).hostname, refused)
        return None
    return post(target, body)


def deliver_webhooks(ctx: ServiceContext, post: Callable[[Target, bytes], int] = http_post,
                     limit: int = 20) -> int:
    """POST each due webhook (outside any transaction), then record the outcome: done on
    2xx, else retried after 10 s, 20 s … and given up after ``WEBHOOK_ATTEMPTS``."""
    now = ctx.clock.now()
    with ctx.db.read() as session:
        due = [(row.id, row.version, row.webhook, json.dumps(render(row)).encode())
               for row in session.scalars(select(_Q).where(
                   _Q.webhook_state == "pending", _Q.webhook_next_at <= now)
                   .order_by(_Q.webhook_next_at).limit(limit))]
    delivered = 0
    for request_id, version, url, body in due:
        status = _post_checked(ctx, post, url, body) if url is not None else None
        ok = status is not None and 200 <= status < 300
        delivered += ok
        with ctx.db.transaction() as session:
            row = session.get(_Q, request_id)
            if row is None or row.version != version:
                continue  # stale: changed meanwhile (another replica delivered it)
            row.webhook_attempts += 1
            if ok or status is None or row.webhook_attempts >= WEBHOOK_ATTEMPTS:
                row.webhook_state, row.webhook_next_at = ("done" if ok else "failed"), None
            else:
                row.webhook_next_at = ctx.clock.now() + timedelta(
                    seconds=WEBHOOK_BACKOFF_SECONDS * 2 ** (row.webhook_attempts - 1))
            row.version += 1
    return delivered
