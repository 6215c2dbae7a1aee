"""Serverless endpoints: named worker specs of a project, and how their workers scale.

An endpoint is a container spec (``services/spec``, the one mapping pods and templates
use) with a template as an optional base (``templates.template_fields``/``merge_over``,
as ``pod create --template``). Its workers are pods whose ``endpoint_id`` is the
endpoint, created and stopped by the autoscaler (``services/autoscale``); deleting the
endpoint cancels its queue and deletes its workers through the ordinary pod delete.

Each worker authenticates with a key of its own, named ``sls-<pod id>`` and scoped to
the endpoint (``api_keys.scope``, ``worker:<endpoint id>``; ``worker_env``): the worker
routes accept only such keys for that endpoint, and the rest of the API refuses them.
The autoscaler revokes a worker's key when it deletes the worker.
"""

from __future__ import annotations

from typing import Any, Protocol

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpucloud.core.errors import InvalidInput, NotFound, Unauthorized
from gpucloud.core.serverless import (
    EndpointCreateRequest,
    EndpointOut,
    EndpointUpdateRequest,
    RequestStatus,
)
from gpucloud.db.models import (
    ApiKeyModel,
    EndpointModel,
    EndpointRequestModel,
    PodModel,
    ProjectModel,
)
from gpucloud.services import pods, serverless_queue
from gpucloud.services.context import ServiceContext, hash_secret, new_id, new_secret
from gpucloud.services.projects import KEY_PREFIX, Principal
from gpucloud.services.serverless_queue import get_endpoint_row
from gpucloud.services.spec import (
    check_gpu_memory,
    check_mig,
    check_spec,
    spec_columns,
    spec_out,
    spec_request,
)
from gpucloud.services.templates import merge_over, template_fields

#: How often workers ping (RUNPOD_PING_INTERVAL, ms): well inside the 30 s lease.
PING_INTERVAL_MS = 10_000
WORKER_KEY_PREFIX = "sls-"
#: The columns ``EndpointCreateRequest``'s scaling fields land in.
_SCALING = {"min_workers": "min_workers", "max_workers": "max_workers",
            "idle_timeout": "idle_timeout_seconds", "scaler": "scaler",
            "scaler_value": "scaler_value", "execution_timeout": "execution_timeout_seconds",
            "max_retries": "max_retries", "gpu_ids": "gpu_ids"}


def _counts(session: Session, endpoint_ids: list[str]) -> dict[str, tuple[int, int, int]]:
    """Per endpoint: workers running, of them idle, requests queued."""
    queued = dict(session.execute(select(EndpointRequestModel.endpoint_id, func.count())
                                  .where(EndpointRequestModel.endpoint_id.in_(endpoint_ids),
                                         EndpointRequestModel.status
                                         == RequestStatus.IN_QUEUE.value)
                                  .group_by(EndpointRequestModel.endpoint_id)).all())
    out = {}
    for endpoint_id in endpoint_ids:
        running, idle = serverless_queue.worker_counts(session, endpoint_id)
        out[endpoint_id] = (running, idle, int(queued.get(endpoint_id, 0)))
    return out


def endpoint_out(endpoint: EndpointModel, project_name: str,
                 counts: tuple[int, int, int] = (0, 0, 0)) -> EndpointOut:
    workers, idle, queue = counts
    return EndpointOut(
        id=endpoint.id, name=endpoint.name, project=project_name, gpus=endpoint.gpus,
        ports=endpoint.ports, template=endpoint.template, gpu_ids=endpoint.gpu_ids,
        min_workers=endpoint.min_workers, max_workers=endpoint.max_workers,
        idle_timeout_seconds=endpoint.idle_timeout_seconds, scaler=endpoint.scaler,
        scaler_value=endpoint.scaler_value,
        execution_timeout_seconds=endpoint.execution_timeout_seconds,
        max_retries=endpoint.max_retries, workers=workers, workers_idle=idle, queue=queue,
        created_at=endpoint.created_at, **spec_out(endpoint))


def _checked(ctx: ServiceContext, caller: Principal,
             request: EndpointCreateRequest) -> EndpointCreateRequest:
    """The request over its template (if any), its spec checked as a pod's would be."""
    if request.template is not None:
        given = request.model_dump(include=request.model_fields_set)
        request = merge_over(EndpointCreateRequest,
                             template_fields(ctx, caller, request.template), given)
    if request.image is None:
        raise InvalidInput("image", "field required (or name a template)")
    if request.min_workers > request.max_workers:
        raise InvalidInput("max_workers", f"must be at least min_workers "
                           f"({request.min_workers})")
    check_spec(ctx, caller.project_id, request)
    check_mig(request, request.gpus)
    check_gpu_memory(request, request.gpus)
    return request


def _scaling_columns(request: EndpointCreateRequest) -> dict[str, Any]:
    values = {column: getattr(request, name) for name, column in _SCALING.items()}
    values["scaler"] = request.scaler.value
    return values


def create_endpoint(ctx: ServiceContext, caller: Principal,
                    request: EndpointCreateRequest) -> EndpointOut:
    request = _checked(ctx, caller, request)
    now = ctx.clock.now()
    endpoint = EndpointModel(
        id=new_id(), project_id=caller.project_id, name=request.name, gpus=request.gpus,
        ports=request.ports, template=request.template, created_at=now, updated_at=now,
        version=0, **_scaling_columns(request), **spec_columns(request))
    try:
        with ctx.db.transaction() as session:
            session.add(endpoint)
            session.flush()
            return endpoint_out(endpoint, caller.project_name)
    except IntegrityError:
        raise InvalidInput("name", f"an endpoint named {request.name!r} already exists in "
                           f"project {caller.project_name!r}") from None


def list_endpoints(ctx: ServiceContext, caller: Principal) -> list[EndpointOut]:
    with ctx.db.read() as session:
        rows = list(session.scalars(select(EndpointModel).where(
            EndpointModel.project_id == caller.project_id,
            EndpointModel.deleted_at.is_(None)).order_by(EndpointModel.name)))
        counts = _counts(session, [row.id for row in rows])
        return [endpoint_out(row, caller.project_name, counts[row.id]) for row in rows]


def get_endpoint(ctx: ServiceContext, caller: Principal, ref: str) -> EndpointOut:
    with ctx.db.read() as session:
        row = get_endpoint_row(session, caller, ref)
        return endpoint_out(row, caller.project_name, _counts(session, [row.id])[row.id])


def _as_request(row: EndpointModel) -> dict[str, Any]:
    """An endpoint row back in create-request form (the base an update applies to)."""
    values: dict[str, Any] = {**spec_request(row), "name": row.name, "gpus": row.gpus,
                              "ports": list(row.ports)}
    values.update({name: getattr(row, column) for name, column in _SCALING.items()})
    return {key: value for key, value in values.items() if value is not None}


def update_endpoint(ctx: ServiceContext, caller: Principal, ref: str,
                    request: EndpointUpdateRequest) -> EndpointOut:
    """Change any field; workers started from now on get the new spec. With
    ``template``, the template's spec replaces the endpoint's before the given fields."""
    given = request.model_dump(include=request.model_fields_set, exclude={"template"})
    with ctx.db.read() as session:
        row = get_endpoint_row(session, caller, ref)
        base, endpoint_id, version = _as_request(row), row.id, row.version
    if request.template is not None:
        base = {**base, **template_fields(ctx, caller, request.template)}
    merged = _checked(ctx, caller, merge_over(EndpointCreateRequest, base, given))
    values = {**_scaling_columns(merged), **spec_columns(merged), "gpus": merged.gpus,
              "ports": merged.ports, "updated_at": ctx.clock.now(), "version": version + 1}
    if request.template is not None:
        values["template"] = request.template
    with ctx.db.transaction() as session:
        result = session.execute(update(EndpointModel).where(
            EndpointModel.id == endpoint_id, EndpointModel.version == version).values(
            **values))
        if not serverless_queue._rowcount(result):
            raise InvalidInput("endpoint", "changed meanwhile; try again")
    return get_endpoint(ctx, caller, endpoint_id)


def delete_endpoint(ctx: ServiceContext, caller: Principal, ref: str) -> None:
    """Cancel its queue, revoke its workers' keys, then delete its workers (ordinary pod
    deletes: their agents stop them, metering closes)."""
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        endpoint = get_endpoint_row(session, caller, ref)
        endpoint.deleted_at, endpoint.version = now, endpoint.version + 1
        cancelled = serverless_queue.cancel_all(session, endpoint.id, now)
        session.execute(update(ApiKeyModel).where(
            ApiKeyModel.scope == worker_scope(endpoint.id),
            ApiKeyModel.revoked_at.is_(None)).values(revoked_at=now))
        workers = list(session.scalars(select(PodModel.id).where(
            PodModel.endpoint_id == endpoint.id, PodModel.deleted_at.is_(None))))
    ctx.cache.clear()  # the revoked worker keys
    for request_id in cancelled:
        serverless_queue.WAKEUPS.notify(f"r:{request_id}")
    for pod_id in workers:
        try:
            pods.delete_pod(ctx, caller, pod_id)
        except NotFound:
            continue  # deleted meanwhile


# --- workers ---------------------------------------------------------------------


class HasEndpointId(Protocol):
    @property
    def id(self) -> str: ...


def worker_env(ctx: ServiceContext, endpoint: HasEndpointId, pod_id: str,
               base_url: str) -> dict[str, str]:
    """The env a worker pod needs for the ``runpod`` SDK to serve the endpoint from this
    server: the job-take/done/stream/ping URLs (with ``?`` already, and the ``$ID`` /
    ``$RUNPOD_POD_ID`` placeholders the SDK fills in) and a new worker key.

    ``pod_id`` is the worker's pod id or its name (the worker routes resolve either
    within the endpoint), since a pod's id is chosen by ``create_pod``."""
    with ctx.db.transaction() as session:
        row = session.get(EndpointModel, endpoint.id)
        if row is None or row.deleted_at is not None:
            raise NotFound(f"endpoint {endpoint.id!r} not found")
        secret = new_secret(KEY_PREFIX)
        session.add(ApiKeyModel(
            id=new_id(), project_id=row.project_id, name=_worker_key_name(pod_id),
            prefix=secret[:10], key_hash=hash_secret(secret), created_at=ctx.clock.now(),
            revoked_at=None, scope=worker_scope(row.id)))
    root = f"{base_url.rstrip('/')}/v2/_worker/{endpoint.id}"
    return {
        "RUNPOD_WEBHOOK_GET_JOB": f"{root}/job-take/$ID?gpucloud=1",
        "RUNPOD_WEBHOOK_POST_OUTPUT": f"{root}/job-done/$RUNPOD_POD_ID/$ID?gpucloud=1",
        "RUNPOD_WEBHOOK_POST_STREAM": f"{root}/job-stream/$RUNPOD_POD_ID/$ID?gpucloud=1",
        "RUNPOD_WEBHOOK_PING": f"{root}/ping/$RUNPOD_POD_ID?gpucloud=1",
        "RUNPOD_AI_API_KEY": secret,
        "RUNPOD_POD_ID": pod_id,
        "RUNPOD_ENDPOINT_ID": endpoint.id,
        "RUNPOD_PING_INTERVAL": str(PING_INTERVAL_MS),
    }


def _worker_key_name(pod_id: str) -> str:
    return (WORKER_KEY_PREFIX + pod_id)[:63]


def worker_scope(endpoint_id: str) -> str:
    """The scope of an endpoint's worker keys: its worker routes, nothing else."""
    return f"worker:{endpoint_id}"


def revoke_worker_key(ctx: ServiceContext, endpoint_id: str, pod_id: str) -> None:
    """Revoke the key of one worker (the autoscaler deleted its pod)."""
    with ctx.db.transaction() as session:
        session.execute(update(ApiKeyModel).where(
            ApiKeyModel.scope == worker_scope(endpoint_id),
            ApiKeyModel.name == _worker_key_name(pod_id),
            ApiKeyModel.revoked_at.is_(None)).values(revoked_at=ctx.clock.now()))
    ctx.cache.clear()


def authenticate_worker(ctx: ServiceContext, key: str | None, endpoint_id: str,
                        worker_ref: str) -> str:
    """The worker pod's id for a worker route: the key must be a live worker key of this
    endpoint, and ``worker_ref`` a worker pod of it (a live one by id or name, or a
    deleted one by id: ``take`` gives it nothing, so its polls get 204, not errors that
    the SDK would retry at once).

    A deleted worker's key is revoked with its pod, yet its container polls on until its
    agent stops it: that key still names the deleted pod it was made for (by id), and is
    answered as that pod's, not refused. Refused, the SDK would retry each poll at once,
    and every refusal would count against the caller's address, which the agent and the
    node's other workers share (host network): its failure bucket empty, the agent's
    lease renewals were refused too and the node went Lost."""
    if not key:
        raise Unauthorized("missing worker key (send 'Authorization: KEY')")
    cache_key = f"sls:{hash_secret(key)}:{endpoint_id}:{worker_ref}"
    cached = ctx.cache.get(cache_key)
    if isinstance(cached, str):
        return cached
    with ctx.db.read() as session:
        found = session.execute(select(ApiKeyModel.project_id, ApiKeyModel.name,
                                       ApiKeyModel.revoked_at).join(
            ProjectModel, ProjectModel.id == ApiKeyModel.project_id).where(
            ApiKeyModel.key_hash == hash_secret(key),
            ApiKeyModel.scope == worker_scope(endpoint_id))).first()
        if found is None:
            raise Unauthorized("invalid or revoked worker key for this endpoint")
        project_id, key_name, revoked_at = found
        if revoked_at is not None:
            pod_id = session.scalar(select(PodModel.id).where(
                PodModel.endpoint_id == endpoint_id, PodModel.project_id == project_id,
                PodModel.id == worker_ref, PodModel.deleted_at.is_not(None)))
            if pod_id is None or key_name != _worker_key_name(pod_id):
                raise Unauthorized("invalid or revoked worker key for this endpoint")
        else:
            pod_id = session.scalar(select(PodModel.id).where(
                PodModel.endpoint_id == endpoint_id, PodModel.project_id == project_id,
                PodModel.deleted_at.is_(None),
                (PodModel.id == worker_ref) | (PodModel.name == worker_ref)))
        if pod_id is None:  # a worker being stopped polls on until its agent stops it:
            pod_id = session.scalar(select(PodModel.id).where(  # it gets 204s, no jobs
                PodModel.endpoint_id == endpoint_id, PodModel.id == worker_ref))
    if pod_id is None:
        raise NotFound(f"no live worker {worker_ref!r} of endpoint {endpoint_id!r}")
    ctx.cache.put(cache_key, pod_id)
    return pod_id
