"""The serverless autoscaler: one pass sizes every endpoint's workers from its queue.

Workers are ordinary pods of the endpoint's project (``PodModel.endpoint_id``), created
and deleted through ``services.pods``, so the scheduler places them (priorities, quotas,
spend limits apply) and the meter bills them like any pod. A pass, per endpoint:

1. Workers that ended (``Failed``, ``Stopped``, ``Succeeded``, ``Lost``) are deleted;
   ``serverless_queue.expire`` requeues what they held at once (a gone worker's lease
   is void), and step 2 replaces them.
2. The desired count (``desired_workers``, a pure function of the queue's stats and the
   endpoint's settings) is clamped to ``min_workers..max_workers``; missing workers are
   created, named ``<endpoint>-w-<n>``.
3. Workers beyond the desired count that have had nothing in flight for
   ``idle_timeout_seconds`` are deleted, never below ``min_workers``.

The pass reads first, then writes through the ordinary services (no network call inside a
transaction); a create refused by the project's limits is logged and retried next pass.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from gpucloud.core.errors import GpucloudError
from gpucloud.core.gpu_models import canonical_name
from gpucloud.core.models import PodCreateRequest
from gpucloud.core.phases import TERMINAL_PHASES, NodeStatus, PodPhase
from gpucloud.core.serverless import gpu_types_for_pools
from gpucloud.db.models import EndpointModel, NodeModel, PodModel, ProjectModel
from gpucloud.services import endpoints, pods, serverless_queue
from gpucloud.services.context import ServiceContext, new_id
from gpucloud.services.projects import Principal
from gpucloud.services.serverless_queue import QueueStats
from gpucloud.services.spec import spec_request

log = logging.getLogger(__name__)
QUEUE_DELAY = "queue-delay"
REQUEST_COUNT = "request-count"
#: Where workers reach the server when ``Settings.serverless_url`` is not set: the
#: default of ``gpucloud server`` on a host-network node.
DEFAULT_BASE_URL = "http://127.0.0.1:8080"
#: Pod names are DNS labels (63 characters): room for ``-w-`` and a number.
_NAME_ROOM = 63 - len("-w-999")


@dataclass(frozen=True)
class Sizing:
    """What sizing reads of an endpoint (its row's settings)."""

    min_workers: int
    max_workers: int
    scaler: str
    scaler_value: int

    @classmethod
    def of(cls, endpoint: EndpointModel) -> Sizing:
        return cls(endpoint.min_workers, endpoint.max_workers, endpoint.scaler,
                   endpoint.scaler_value)


@dataclass(frozen=True)
class Load:
    """An endpoint's queue as sizing reads it (from ``serverless_queue.queue_stats``)."""

    in_queue: int = 0
    in_progress: int = 0
    #: Workers with at least one request in flight.
    busy: int = 0
    oldest_queued_at: datetime | None = None

    @classmethod
    def of(cls, stats: QueueStats | None) -> Load:
        if stats is None:
            return cls()
        return cls(stats.in_queue, stats.in_progress,
                   len([n for n in stats.in_flight.values() if n > 0]), stats.oldest_queued_at)

    def waited(self, now: datetime) -> float:
        """Seconds the oldest queued request has waited (0 when none waits)."""
        if self.oldest_queued_at is None:
            return 0.0
        return (now - _aware(self.oldest_queued_at)).total_seconds()


def desired_workers(sizing: Sizing, load: Load, current: int, now: datetime) -> int:
    """How many workers the endpoint should have now, clamped to min..max.

    ``request-count``: one worker per ``scaler_value`` requests queued or in flight.
    ``queue-delay``: keep the busy workers and those the queue will keep busy; add one
    when the oldest queued request has waited ``scaler_value`` seconds, or at once when no
    worker runs (scale from zero): one step per pass, as RunPod's scaler adds capacity
    once requests wait that long.
    """
    if sizing.scaler == REQUEST_COUNT:
        wanted = math.ceil((load.in_queue + load.in_progress) / max(1, sizing.scaler_value))
    else:
        wanted = max(load.busy, min(current, load.busy + load.in_queue))
        if load.in_queue and (current == 0 or load.waited(now) >= sizing.scaler_value):
            wanted = max(wanted, current + 1)
    return max(sizing.min_workers, min(sizing.max_workers, wanted))


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


@dataclass(frozen=True)
class Worker:
    id: str
    name: str
    phase: PodPhase
    idle_since: datetime | None
    in_flight: int

    @property
    def ended(self) -> bool:
        return self.phase in TERMINAL_PHASES


def idle_workers(workers: list[Worker], idle_timeout: float, now: datetime) -> list[Worker]:
    """Workers with nothing in flight for ``idle_timeout`` seconds, longest idle first."""
    limit = now - timedelta(seconds=idle_timeout)
    idle = [w for w in workers if w.in_flight == 0 and w.idle_since is not None
            and _aware(w.idle_since) <= limit]
    return sorted(idle, key=lambda w: _aware(w.idle_since or now))


def autoscale(ctx: ServiceContext) -> list[str]:
    """One pass over every live endpoint; returns what it did (``+name``, ``-name``)."""
    stats = serverless_queue.queue_stats(ctx)
    if not stats:
        return []  # no endpoint: one query per pass
    done: list[str] = []
    for endpoint, principal, workers in _endpoints(ctx, stats):
        try:
            done += _scale(ctx, endpoint, principal, workers, stats.get(endpoint.id))
        except GpucloudError as error:
            log.warning("endpoint %s: workers not scaled: %s", endpoint.name, error.message)
    return done


def _endpoints(ctx: ServiceContext, stats: Mapping[str, QueueStats]
               ) -> list[tuple[EndpointModel, Principal, list[Worker]]]:
    with ctx.db.read() as session:
        rows = session.execute(
            select(EndpointModel, ProjectModel.name)
            .join(ProjectModel, ProjectModel.id == EndpointModel.project_id)
            .where(EndpointModel.deleted_at.is_(None))
        ).all()
        found = session.execute(
            select(PodModel.endpoint_id, PodModel.id, PodModel.name, PodModel.phase,
                   PodModel.worker_idle_since)
            .where(PodModel.endpoint_id.is_not(None), PodModel.deleted_at.is_(None))
        ).all()
        session.expunge_all()
    by_endpoint: dict[str, list[Worker]] = {}
    for endpoint_id, pod_id, name, phase, idle_since in found:
        endpoint_stats = stats.get(str(endpoint_id))
        flight = endpoint_stats.in_flight.get(pod_id, 0) if endpoint_stats else 0
        by_endpoint.setdefault(str(endpoint_id), []).append(
            Worker(pod_id, name, PodPhase(phase), idle_since, flight))
    return [(endpoint, Principal(project_id=endpoint.project_id, project_name=project,
                                 is_admin=False), by_endpoint.get(endpoint.id, []))
            for endpoint, project in rows]


def _scale(ctx: ServiceContext, endpoint: EndpointModel, principal: Principal,
           workers: list[Worker], stats: QueueStats | None) -> list[str]:
    now = ctx.clock.now()
    done = _remove_ended(ctx, principal, endpoint.id, [w for w in workers if w.ended])
    live = [w for w in workers if not w.ended]
    want = desired_workers(Sizing.of(endpoint), Load.of(stats), len(live), now)
    if want > len(live):
        taken = {w.name for w in live}  # an ended worker was deleted: its name is free
        for _ in range(want - len(live)):
            name = _free_name(endpoint.name, taken)
            taken.add(name)
            _create_worker(ctx, endpoint, principal, name)
            done.append(f"+{name}")
        return done
    surplus = len(live) - max(want, endpoint.min_workers)
    for worker in idle_workers(live, endpoint.idle_timeout_seconds, now)[:max(0, surplus)]:
        _delete_worker(ctx, principal, endpoint.id, worker.id)
        done.append(f"-{worker.name}")
    return done


def _remove_ended(ctx: ServiceContext, principal: Principal, endpoint_id: str,
                  ended: list[Worker]) -> list[str]:
    """Delete workers that ended (their names free for replacements); what they held goes
    back to the queue through ``serverless_queue.expire`` (a gone worker's lease is void)."""
    for worker in ended:
        log.info("worker %s ended (%s): replaced", worker.name, worker.phase.value)
        _delete_worker(ctx, principal, endpoint_id, worker.id)
    return [f"-{w.name}" for w in ended]


def _delete_worker(ctx: ServiceContext, principal: Principal, endpoint_id: str,
                   pod_id: str) -> None:
    """An ordinary pod delete (its agent stops it, metering closes), and its key goes."""
    pods.delete_pod(ctx, principal, pod_id)
    endpoints.revoke_worker_key(ctx, endpoint_id, pod_id)


def _free_name(endpoint_name: str, taken: set[str]) -> str:
    n = 1
    while f"{endpoint_name[:_NAME_ROOM]}-w-{n}" in taken:
        n += 1
    return f"{endpoint_name[:_NAME_ROOM]}-w-{n}"


def _create_worker(ctx: ServiceContext, endpoint: EndpointModel, principal: Principal,
                   name: str) -> None:
    """A worker pod: the endpoint's spec, its env plus the worker API's (the pod id is
    chosen first: the env names it)."""
    pod_id = new_id()
    base_url = ctx.settings.serverless_url or DEFAULT_BASE_URL
    fields = spec_request(endpoint)
    if endpoint.gpu_type is None and endpoint.gpu_ids and endpoint.gpus:
        fields["gpu_type"] = pool_gpu_type(ctx, endpoint.gpu_ids)
    fields["env"] = {**endpoint.env,
                     **endpoints.worker_env(ctx, endpoint, pod_id, base_url)}
    request = PodCreateRequest.model_validate(
        {**fields, "name": name, "gpus": endpoint.gpus, "ports": list(endpoint.ports)})
    pods.create_pod(ctx, principal, request, pod_id=pod_id, endpoint_id=endpoint.id)


def pool_gpu_type(ctx: ServiceContext, gpu_ids: str) -> str:
    """The GPU model for a worker of RunPod GPU pools (``AMPERE_80,ADA_80_PRO``): the
    first model of the pools, in their order, that a Ready node has; else the first
    (the worker waits Pending for such a node, as any pod)."""
    candidates = gpu_types_for_pools(gpu_ids)
    with ctx.db.read() as session:
        fleet = {canonical_name(str(gpu.get("model", ""))) for (gpus,) in session.execute(
            select(NodeModel.gpus).where(NodeModel.status == NodeStatus.READY.value))
            for gpu in gpus}
    return next((model for model in candidates if model in fleet), candidates[0])
