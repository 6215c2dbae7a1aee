"""Nodes: join tokens, registration, leases with fencing tokens, cordoning, lease expiry."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from gpucloud.access.keys import gateway_public_keys
from gpucloud.core.capabilities import NodeCapabilities
from gpucloud.core.errors import NotFound, Unauthorized
from gpucloud.core.gpu_models import canonical_name
from gpucloud.core.models import (
    GpuInventory,
    JoinTokenOut,
    JoinTokenRequest,
    LeaseRequest,
    LeaseResponse,
    NodeGpuActionRequest,
    NodeOut,
    NodeRegisterRequest,
    NodeRegisterResponse,
)
from gpucloud.core.phases import (
    ACTIVE_PHASE_VALUES,
    NodeStatus,
    PodPhase,
    RestartPolicy,
    should_restart,
)
from gpucloud.core.spot import DrainState, NodeDrainOut, StopReason
from gpucloud.db.models import NodeModel, PodModel
from gpucloud.db.session import on_commit, rows_changed
from gpucloud.services import gpu_maintenance, join_tokens, lease_ttl, spot, wakeups
from gpucloud.services.context import (
    ServiceContext,
    hash_secret,
    new_id,
    new_secret,
    secret_matches,
)
from gpucloud.services.events import transition
from gpucloud.services.fencing import check_fencing
from gpucloud.services.pods import complete_restart, requeue
from gpucloud.services.projects import Principal
from gpucloud.services.scheduling import retry_unschedulable


def create_join_token(ctx: ServiceContext, caller: Principal,
                      request: JoinTokenRequest | None = None) -> JoinTokenOut:
    return join_tokens.create(ctx, caller, request)


def _normalized_gpus(gpus: list[GpuInventory]) -> list[dict[str, object]]:
    """Inventory as stored: an index for each GPU and the catalog's model name."""
    out = []
    for position, gpu in enumerate(gpus):
        data = gpu.model_dump()
        data["index"] = position if gpu.index is None else gpu.index
        data["model"] = canonical_name(gpu.model)
        out.append(data)
    return out


def register_node(ctx: ServiceContext, request: NodeRegisterRequest,
                  before_commit: Callable[[], None] | None = None) -> NodeRegisterResponse:
    """Register (or re-register) a node by name; a new node token and a new lease grant.

    A re-registering node keeps its id and pods; its fencing token moves on, so writes of
    any earlier incarnation of the agent are refused from now on. Only a new node spends
    a use of the join token, by a statement of its own, before the transaction (given
    back if the registration fails): no lock on the token's row while the node is
    written (services/join_tokens). ``before_commit`` runs last inside the transaction:
    what it raises rolls the registration back (api/register_capacity.py: the agent
    gave it up meanwhile), the join token's use given back.
    """
    now = ctx.clock.now()
    with ctx.db.read() as session:
        known = session.scalar(select(NodeModel.id).where(NodeModel.name == request.name))
        if known is not None:
            join_tokens.check(session, request.join_token, now)
    spent = None if known is not None else join_tokens.spend(ctx, request.join_token, now)
    try:
        return _register(ctx, request, now, before_commit)
    except BaseException:
        if spent is not None:
            join_tokens.refund(ctx, spent)
        raise


def _register(ctx: ServiceContext, request: NodeRegisterRequest, now: datetime,
              before_commit: Callable[[], None] | None) -> NodeRegisterResponse:
    secret = new_secret("gpn")
    ttl = lease_ttl.current(ctx)
    gateway_keys = _gateway_keys(ctx.settings.home)
    with ctx.db.transaction() as session:
        node = session.scalar(select(NodeModel).where(NodeModel.name == request.name))
        if node is not None:  # its old token is refused from now on, on every replica:
            # that one token is forgotten, not the whole cache (every other agent's next
            # request would miss it, a storm's worth of misses in a fleet re-registering)
            on_commit(session, partial(ctx.cache.forget, _NODE_TOKEN + node.token_hash))
        if node is None:
            node = NodeModel(id=new_id(), name=request.name, registered_at=now, fencing_token=0,
                             assignments_revision=0, version=0, cordoned=False)
            session.add(node)
        node.token_hash = hash_secret(secret)
        node.cpu_milli = round(request.cpu_cores * 1000)
        node.memory_bytes = request.memory_bytes
        node.gpus = _normalized_gpus(request.gpus)
        node.labels = request.labels
        node.address = request.address
        node.provider = request.provider
        _set_access(node, request)
        _grant(node, now, ttl)
        _announce(session, node.id)
        retry_unschedulable(session)
        if before_commit is not None:
            before_commit()
        return NodeRegisterResponse(node_id=node.id, name=node.name, node_token=secret,
                                    fencing_token=node.fencing_token, lease_ttl_seconds=ttl,
                                    gateway_public_keys=gateway_keys)


#: The gateway's public key lines by server home, read once: the gateway logs in with the
#: key it loaded once too (access/upstream.py), and a registration read and parsed the
#: private key file each time (~5 % of its CPU in a fleet's ramp).
_GATEWAY_KEYS: dict[Path, list[str]] = {}


def _gateway_keys(home: Path) -> list[str]:
    keys = _GATEWAY_KEYS.get(home)
    if keys is None:
        keys = _GATEWAY_KEYS[home] = gateway_public_keys(home)
    return list(keys)


def _set_access(node: NodeModel, request: NodeRegisterRequest) -> None:
    """Where the gateway reaches this node's access server, and how the node is set up."""
    node.access_endpoint = request.access_endpoint
    node.access_host_key = request.access_host_key
    node.network_mode = request.network_mode
    node.volume_mode = request.volume_mode
    node.capabilities = request.capabilities.model_dump()


def _announce(session: Session, node_id: str) -> None:
    """Wake the node's assignment long polls once this revision bump commits."""
    on_commit(session, partial(wakeups.ASSIGNMENTS.notify, node_id))


def _grant(node: NodeModel, now: datetime, ttl: float) -> None:
    node.fencing_token += 1
    node.status = NodeStatus.READY.value
    node.lease_expires_at = now + timedelta(seconds=ttl)
    node.lease_renewed_at = now
    node.version += 1
    node.assignments_revision += 1


_NODE_TOKEN = "node:"


def cached_node(ctx: ServiceContext, token: str | None) -> str | None:
    """The node of a token authenticated in the last few seconds (``ctx.cache``, as API
    keys are), without a query. A node's re-registration replaces its token and forgets
    the old one here and, as a hint, on the other replicas; elsewhere the old token lives
    at most the cache TTL, and every write it could make is refused by the fencing
    token, which re-registration moved on."""
    if not token:
        return None
    cached = ctx.cache.get(_NODE_TOKEN + hash_secret(token))
    return cached if isinstance(cached, str) else None


def authenticate_node(ctx: ServiceContext, token: str | None) -> str:
    """The id of the node whose agent holds ``token``."""
    if not token:
        raise Unauthorized("missing node token")
    cached = cached_node(ctx, token)
    if cached is not None:
        return cached
    with ctx.db.read() as session:
        row = session.execute(  # by hash: see secret_matches for why that is safe
            select(NodeModel.id, NodeModel.token_hash)
            .where(NodeModel.token_hash == hash_secret(token))
        ).first()
    if row is None or not secret_matches(token, row[1]):
        raise Unauthorized("invalid node token")
    remember_node(ctx, row[1], str(row[0]))
    return str(row[0])


def remember_node(ctx: ServiceContext, token_hash: str, node_id: str) -> None:
    """Cache a node token just authenticated (by its hash) for ``cached_node``."""
    ctx.cache.put(_NODE_TOKEN + token_hash, node_id)


def renew_current(ctx: ServiceContext, token: str, request: LeaseRequest) -> LeaseResponse | None:
    """A renewal's hot path: one guarded ``UPDATE … RETURNING`` (one round trip) that
    authenticates the node token by its hash, checks the fencing token, and extends the
    grant only while it is current (``Ready``, not lapsed) and there is no health to
    apply. None when it changed nothing — a new grant asked for, a stale token, a lapsed
    or lost lease, health news, an unknown token: the caller then takes the full path
    (``authenticate_node`` and ``renew_lease``), which gives each its answer (401, 409,
    a new grant). A lapse races ``expire_leases`` on the row lock: whichever lands first
    wins, and the other's guard then matches nothing."""
    if request.fencing_token is None or request.gpu_health is not None \
            or request.node_fault is not None or request.gpu_actions:
        return None
    now = ctx.clock.now()
    ttl = lease_ttl.current(ctx)
    expires = now + timedelta(seconds=ttl)
    guard = [NodeModel.token_hash == hash_secret(token),
             NodeModel.fencing_token == request.fencing_token,
             NodeModel.status == NodeStatus.READY.value, NodeModel.lease_expires_at > now]
    if request.auto_uncordon:
        guard.append(NodeModel.cordon_reason.is_(None))  # else: uncordon (full path)
    row = ctx.db.first_atomic(
        update(NodeModel).where(*guard)
        .values(lease_expires_at=expires, lease_renewed_at=now)
        .returning(NodeModel.token_hash))
    if row is None or not secret_matches(token, row[0]):
        return None
    return LeaseResponse(fencing_token=request.fencing_token, lease_expires_at=expires,
                         lease_ttl_seconds=ttl, new_grant=False)


def _apply_health(node: NodeModel, health: LeaseRequest) -> None:
    """Mark each reported GPU healthy or not (the scheduler skips unhealthy ones); cordon
    the node on a node-level fault with its reason, uncordon it when the fault is gone and
    the agent says so (never a cordon an operator made: that has no reason)."""
    if health.gpu_health is not None:
        by_uuid = {g.uuid: g for g in health.gpu_health}
        gpus = []
        for gpu in node.gpus:
            report = by_uuid.get(gpu["uuid"])
            if report is not None:
                gpu = {**gpu, "healthy": report.healthy, "health_reason": report.reason}
            gpus.append(gpu)
        node.gpus = gpus
    if health.node_fault is not None:
        if not node.cordoned or node.cordon_reason is not None:
            node.cordoned, node.cordon_reason = True, health.node_fault
    elif node.cordon_reason is not None and health.auto_uncordon:
        node.cordoned, node.cordon_reason = False, None


def renew_lease(ctx: ServiceContext, node_id: str, fencing_token: int | None,
                health: LeaseRequest | None = None,
                received_at: datetime | None = None) -> LeaseResponse:
    """Renew the current grant, or make a new one (token + 1) when asked or when it lapsed.

    A token that is not the current one is stale: 409, nothing changes. A renewal's new
    expiry counts from ``received_at`` (when the server got it) where given.
    """
    now = ctx.clock.now()
    ttl = lease_ttl.current(ctx)
    with ctx.db.transaction() as session:
        node = session.get_one(NodeModel, node_id, with_for_update=True)
        if fencing_token is not None:
            check_fencing(node, fencing_token)
        lapsed = node.status == NodeStatus.LOST.value or (
            node.lease_expires_at is not None and node.lease_expires_at <= now
        )
        new_grant = fencing_token is None or lapsed
        if health is not None:
            _apply_health(node, health)
            expired = gpu_maintenance.expire(  # MIG switches that waited in vain
                node, now, gpu_maintenance.busy_gpus(session, node.id))
            if gpu_maintenance.apply_results(node, health.gpu_actions, now) or expired:
                node.version += 1
                node.assignments_revision += 1  # the agent drops the answered actions
                _announce(session, node.id)
                retry_unschedulable(session)
        if new_grant:
            _grant(node, now, ttl)
            _announce(session, node.id)
            retry_unschedulable(session)
        else:
            node.lease_expires_at = min(now, received_at or now) + timedelta(seconds=ttl)
            node.lease_renewed_at = now  # a lost node's runs end here (services/meter)
        assert node.lease_expires_at is not None
        return LeaseResponse(fencing_token=node.fencing_token,
                             lease_expires_at=node.lease_expires_at, lease_ttl_seconds=ttl,
                             new_grant=new_grant)


def display_status(node: NodeModel) -> NodeStatus:
    """``Drained`` (its own status: a drained node may go away), ``Lost`` (the lease),
    ``Draining``, else the lease status."""
    if node.drain_state == DrainState.DRAINED.value:
        return NodeStatus.DRAINED
    if node.status == NodeStatus.LOST.value:
        return NodeStatus.LOST
    if node.drain_state is not None:
        return NodeStatus.DRAINING
    return NodeStatus(node.status)


def bound_pods(session: Session, node_id: str) -> list[str]:
    """Names of the pods that hold resources on the node."""
    return list(session.scalars(
        select(PodModel.name).where(PodModel.node_id == node_id,
                                    PodModel.phase.in_(ACTIVE_PHASE_VALUES))
        .order_by(PodModel.name)))


def drain_out(session: Session, node: NodeModel) -> NodeDrainOut | None:
    """The progress of the node's drain (None: not draining)."""
    if node.drain_state is None or node.drain_requested_at is None:
        return None
    pods = bound_pods(session, node.id)
    deadline = None if node.drain_started_at is None or node.drain_deadline_seconds is None \
        else node.drain_started_at + timedelta(seconds=node.drain_deadline_seconds)
    return NodeDrainOut(state=DrainState(node.drain_state), requested_at=node.drain_requested_at,
                        started_at=node.drain_started_at, deadline=deadline,
                        finished_at=node.drain_finished_at, pods_total=node.drain_pods_total,
                        pods_left=len(pods), pods=pods)


def node_out(session: Session, node: NodeModel, gpus_allocated: int) -> NodeOut:
    out = _node_out(node, gpus_allocated)
    out.drain = drain_out(session, node)
    return out


def _node_out(node: NodeModel, gpus_allocated: int) -> NodeOut:
    return NodeOut(
        id=node.id, name=node.name, status=display_status(node), cordoned=node.cordoned,
        cpu_cores=node.cpu_milli / 1000, memory_bytes=node.memory_bytes,
        gpus=[GpuInventory.model_validate(g) for g in node.gpus], gpus_allocated=gpus_allocated,
        labels=node.labels, address=node.address, provider=node.provider,
        fencing_token=node.fencing_token, lease_expires_at=node.lease_expires_at,
        registered_at=node.registered_at, network_mode=node.network_mode,
        volume_mode=node.volume_mode, access_endpoint=node.access_endpoint,
        capabilities=NodeCapabilities.model_validate(node.capabilities or {}),
        mig_policy=node.mig_policy or "dynamic", cordon_reason=node.cordon_reason,
    )


def _allocated_gpus(session: Session) -> dict[str, int]:
    """Whole-GPU equivalents held on each node by its active pods."""
    rows = session.execute(
        select(PodModel.node_id, func.sum(PodModel.gpus))
        .where(PodModel.phase.in_(ACTIVE_PHASE_VALUES), PodModel.node_id.is_not(None))
        .group_by(PodModel.node_id)
    )
    return {node_id: int(total or 0) for node_id, total in rows if node_id}


def list_nodes(ctx: ServiceContext) -> list[NodeOut]:
    with ctx.db.read() as session:
        allocated = _allocated_gpus(session)
        nodes = session.scalars(select(NodeModel).order_by(NodeModel.name))
        return [node_out(session, n, allocated.get(n.id, 0)) for n in nodes]


def _find_node(session: Session, ref: str) -> NodeModel:
    node = session.scalar(select(NodeModel).where((NodeModel.id == ref) | (NodeModel.name == ref)))
    if node is None:
        raise NotFound(f"node {ref!r} not found")
    return node


def get_node(ctx: ServiceContext, ref: str) -> NodeOut:
    with ctx.db.read() as session:
        node = _find_node(session, ref)
        return node_out(session, node, _allocated_gpus(session).get(node.id, 0))


def set_cordoned(ctx: ServiceContext, caller: Principal, ref: str, cordoned: bool) -> NodeOut:
    caller.require_admin()
    with ctx.db.transaction() as session:
        node = _find_node(session, ref)
        if node.cordoned != cordoned:
            node.cordoned = cordoned
            node.version += 1
            if not cordoned:
                # An operator's uncordon ends a health-check cordon too: its reason goes
                # (a fault still there cordons the node again on the next report).
                node.cordon_reason = None
                retry_unschedulable(session)
        return node_out(session, node, _allocated_gpus(session).get(node.id, 0))


def request_gpu_action(ctx: ServiceContext, caller: Principal, ref: str,
                       body: NodeGpuActionRequest) -> NodeOut:
    """``node gpu-reset`` / ``node diag``: the agent runs it and reports (services/
    gpu_maintenance); the GPU shows the request's state under ``maintenance``."""
    caller.require_admin()
    with ctx.db.transaction() as session:
        node = _find_node(session, ref)
        gpu_maintenance.request(node, body.action, body.gpu, body.level, ctx.clock.now(),
                                gpu_maintenance.busy_gpus(session, node.id),
                                body.wait_seconds)
        node.version += 1
        node.assignments_revision += 1
        _announce(session, node.id)
        return node_out(session, node, _allocated_gpus(session).get(node.id, 0))


def lease_health(ctx: ServiceContext) -> tuple[int, int]:
    """(Ready nodes whose lease lapsed, all Ready nodes): the disruption brake's input."""
    now = ctx.clock.now()
    with ctx.db.read() as session:
        lapsed = session.scalar(select(func.count()).select_from(NodeModel).where(
            NodeModel.status == NodeStatus.READY.value, NodeModel.lease_expires_at <= now))
        ready = session.scalar(select(func.count()).select_from(NodeModel).where(
            NodeModel.status == NodeStatus.READY.value))
    return int(lapsed or 0), int(ready or 0)


def rebase_leases(ctx: ServiceContext, alive_at: datetime) -> int:
    """After a clock jump: every Ready lease that was live at ``alive_at`` (the last look
    before the jump), or that now runs past one TTL from now (a jump backwards), expires
    one TTL from now. Forwards, no healthy node looks lapsed (the agents had no chance to
    renew against the new time); backwards, a node that dies is still found within a TTL.
    Leases lapsed before the jump stay lapsed. Returns how many leases it moved."""
    now = ctx.clock.now()
    fresh = now + timedelta(seconds=lease_ttl.current(ctx))
    with ctx.db.transaction() as session:
        return rows_changed(session, update(NodeModel).where(
            NodeModel.status == NodeStatus.READY.value,
            (NodeModel.lease_expires_at > alive_at) | (NodeModel.lease_expires_at > fresh),
        ).values(lease_expires_at=fresh))


def refresh_leases(ctx: ServiceContext, now: datetime) -> int:
    """A new leader's fresh TTL (Nomad): every Ready lease, lapsed or not, expires no
    earlier than one TTL from now. The agents that could not reach a server during the
    failover then renew on the hot path and keep their grants (a lapsed lease could only
    be renewed by a new grant, whose new fencing token refuses their pod reports in
    flight); a node that is really gone is still found one TTL after the change. Returns
    how many leases it moved. ``now`` is the caller's, so that its wait ends exactly
    when the fresh leases can lapse."""
    fresh = now + timedelta(seconds=lease_ttl.current(ctx))
    with ctx.db.transaction() as session:
        return rows_changed(session, update(NodeModel).where(
            NodeModel.status == NodeStatus.READY.value,
            (NodeModel.lease_expires_at < fresh) | NodeModel.lease_expires_at.is_(None),
        ).values(lease_expires_at=fresh))


def set_mig_policy(ctx: ServiceContext, caller: Principal, ref: str, mode: str) -> NodeOut:
    """``gpucloud node mig NODE --mode``: how the node's MIG-capable GPUs take MIG pods.

    Switching a GPU's MIG *mode* stays an admin action on the node at drain time (it needs
    an idle GPU and may reset it); this sets the scheduling policy only.
    """
    caller.require_admin()
    with ctx.db.transaction() as session:
        node = _find_node(session, ref)
        if (node.mig_policy or "dynamic") != mode:
            node.mig_policy = mode
            node.version += 1
            node.assignments_revision += 1
            _announce(session, node.id)
            retry_unschedulable(session)
        return node_out(session, node, _allocated_gpus(session).get(node.id, 0))


def expire_leases(ctx: ServiceContext, limit: int | None = None) -> list[str]:
    """Mark nodes whose lease lapsed ``Lost``; their pods ``Lost``, requeued per policy.

    Returns the names of the nodes it marked, at most ``limit`` (the longest lapsed
    first). Guarded by ``version`` so a renewal that lands first wins. The lapsed grant
    is revoked (fencing token + 1): an agent that was partitioned or paused can neither
    renew it nor write with it when it comes back; it must take a new grant, and by then
    its pods have moved on.
    """
    now = ctx.clock.now()
    if limit is not None and limit <= 0:
        return []
    with ctx.db.transaction() as session:
        expired = session.execute(
            select(NodeModel.id, NodeModel.name, NodeModel.version).where(
                NodeModel.status == NodeStatus.READY.value, NodeModel.lease_expires_at <= now
            ).order_by(NodeModel.lease_expires_at, NodeModel.id).limit(limit)
        ).all()
    lost = []
    for node_id, name, version in expired:
        with ctx.db.transaction() as session:
            marked = rows_changed(session,
                update(NodeModel)
                .where(NodeModel.id == node_id, NodeModel.version == version,
                       NodeModel.lease_expires_at <= now)
                .values(status=NodeStatus.LOST.value, version=NodeModel.version + 1,
                        fencing_token=NodeModel.fencing_token + 1,
                        assignments_revision=NodeModel.assignments_revision + 1),
            )
            if marked:
                _announce(session, node_id)
                _lose_pods(ctx, session, node_id, name, now)
                lost.append(name)
    return lost


def _lose_pods(ctx: ServiceContext, session: Session, node_id: str, node_name: str,
               now: datetime) -> None:
    pods = session.scalars(
        select(PodModel).where(PodModel.node_id == node_id, PodModel.phase.in_(ACTIVE_PHASE_VALUES))
    ).all()
    for pod in pods:
        transition(session, pod, PodPhase.LOST, now, spot.NODE_LOST,
                   f"node {node_name} stopped renewing its lease")
        pod.finished_at = now
        spot.count(session, pod, StopReason.NODE_LOST, now)  # an unannounced interruption
        if pod.job_id is not None or pod.deleted_at is not None:
            continue  # a job's members: the gang restarts as a unit (services/gangs)
        if complete_restart(session, pod, now):
            continue  # its restart's stop can no longer come: it starts again now
        noticed = spot.notice_of(pod)
        wanted = pod.desired_state == "running" or (
            noticed is not None and spot.restarts_after_preemption(pod, noticed.reason))
        if wanted and (spot.restarts_after_loss(pod) or should_restart(
                RestartPolicy(pod.restart_policy), PodPhase.LOST)):
            requeue(session, pod, now, "Rescheduling",
                    f"node {node_name} was lost ({spot.NODE_LOST})")
            spot.avoid(ctx, pod, node_id, now)
            pod.restart_count += 1
