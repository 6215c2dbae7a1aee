"""Nodes: join tokens, registration, leases with fencing tokens, cordoning, lease expiry."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from gpucloud.access.keys import gateway_public_keys
from gpucloud.core.errors import NotFound, StaleFencingToken, Unauthorized
from gpucloud.core.gpu_models import canonical_name
from gpucloud.core.models import (
    GpuInventory,
    JoinTokenOut,
    LeaseResponse,
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
from gpucloud.db.models import JoinTokenModel, NodeModel, PodModel
from gpucloud.db.session import rows_changed
from gpucloud.services.context import ServiceContext, hash_secret, new_id, new_secret
from gpucloud.services.events import transition
from gpucloud.services.pods import requeue
from gpucloud.services.projects import Principal
from gpucloud.services.scheduling import retry_unschedulable


def create_join_token(ctx: ServiceContext, caller: Principal) -> JoinTokenOut:
    caller.require_admin()
    now = ctx.clock.now()
    token = new_secret("gpj")
    expires = now + timedelta(seconds=ctx.settings.join_token_ttl_seconds)
    with ctx.db.transaction() as session:
        session.add(JoinTokenModel(id=new_id(), token_hash=hash_secret(token), created_at=now,
                                   expires_at=expires))
    return JoinTokenOut(token=token, expires_at=expires)


def _check_join_token(session: Session, token: str, now: datetime) -> None:
    row = session.scalar(
        select(JoinTokenModel).where(JoinTokenModel.token_hash == hash_secret(token))
    )
    if row is None or row.expires_at <= now:
        raise Unauthorized("invalid or expired join token")


def _normalized_gpus(gpus: list[GpuInventory]) -> list[dict[str, object]]:
    """Inventory as stored: an index for each GPU and the catalog's model name."""
    out = []
    for position, gpu in enumerate(gpus):
        data = gpu.model_dump()
        data["index"] = position if gpu.index is None else gpu.index
        data["model"] = canonical_name(gpu.model)
        out.append(data)
    return out


def register_node(ctx: ServiceContext, request: NodeRegisterRequest) -> NodeRegisterResponse:
    """Register (or re-register) a node by name; a new node token and a new lease grant.

    A re-registering node keeps its id and pods; its fencing token moves on, so writes of
    any earlier incarnation of the agent are refused from now on.
    """
    now = ctx.clock.now()
    secret = new_secret("gpn")
    ttl = ctx.settings.lease_ttl_seconds
    gateway_keys = gateway_public_keys(ctx.settings.home)
    with ctx.db.transaction() as session:
        _check_join_token(session, request.join_token, now)
        node = session.scalar(select(NodeModel).where(NodeModel.name == request.name))
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
        retry_unschedulable(session)
        return NodeRegisterResponse(node_id=node.id, name=node.name, node_token=secret,
                                    fencing_token=node.fencing_token, lease_ttl_seconds=ttl,
                                    gateway_public_keys=gateway_keys)


def _set_access(node: NodeModel, request: NodeRegisterRequest) -> None:
    """Where the gateway reaches this node's access server, and how the node is set up."""
    node.access_endpoint = request.access_endpoint
    node.access_host_key = request.access_host_key
    node.network_mode = request.network_mode
    node.volume_mode = request.volume_mode


def _grant(node: NodeModel, now: datetime, ttl: float) -> None:
    node.fencing_token += 1
    node.status = NodeStatus.READY.value
    node.lease_expires_at = now + timedelta(seconds=ttl)
    node.version += 1
    node.assignments_revision += 1


def authenticate_node(ctx: ServiceContext, token: str | None) -> str:
    """The id of the node whose agent holds ``token``."""
    if not token:
        raise Unauthorized("missing node token")
    with ctx.db.transaction() as session:
        node_id = session.scalar(
            select(NodeModel.id).where(NodeModel.token_hash == hash_secret(token))
        )
    if node_id is None:
        raise Unauthorized("invalid node token")
    return node_id


def check_fencing(node: NodeModel, token: int) -> None:
    if token != node.fencing_token:
        raise StaleFencingToken(
            f"stale fencing token {token} (current {node.fencing_token}); renew the lease"
        )


def renew_lease(ctx: ServiceContext, node_id: str, fencing_token: int | None) -> LeaseResponse:
    """Renew the current grant, or make a new one (token + 1) when asked or when it lapsed.

    A token that is not the current one is stale: 409, nothing changes.
    """
    now = ctx.clock.now()
    ttl = ctx.settings.lease_ttl_seconds
    with ctx.db.transaction() as session:
        node = session.get_one(NodeModel, node_id, with_for_update=True)
        if fencing_token is not None:
            check_fencing(node, fencing_token)
        lapsed = node.status == NodeStatus.LOST.value or (
            node.lease_expires_at is not None and node.lease_expires_at <= now
        )
        new_grant = fencing_token is None or lapsed
        if new_grant:
            _grant(node, now, ttl)
            retry_unschedulable(session)
        else:
            node.lease_expires_at = now + timedelta(seconds=ttl)
        assert node.lease_expires_at is not None
        return LeaseResponse(fencing_token=node.fencing_token,
                             lease_expires_at=node.lease_expires_at, lease_ttl_seconds=ttl,
                             new_grant=new_grant)


def _node_out(node: NodeModel, gpus_allocated: int) -> NodeOut:
    return NodeOut(
        id=node.id, name=node.name, status=NodeStatus(node.status), cordoned=node.cordoned,
        cpu_cores=node.cpu_milli / 1000, memory_bytes=node.memory_bytes,
        gpus=[GpuInventory.model_validate(g) for g in node.gpus], gpus_allocated=gpus_allocated,
        labels=node.labels, address=node.address, provider=node.provider,
        fencing_token=node.fencing_token, lease_expires_at=node.lease_expires_at,
        registered_at=node.registered_at, network_mode=node.network_mode,
        volume_mode=node.volume_mode, access_endpoint=node.access_endpoint,
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
        return [_node_out(n, allocated.get(n.id, 0)) for n in nodes]


def _find_node(session: Session, ref: str) -> NodeModel:
    node = session.scalar(select(NodeModel).where((NodeModel.id == ref) | (NodeModel.name == ref)))
    if node is None:
        raise NotFound(f"node {ref!r} not found")
    return node


def get_node(ctx: ServiceContext, ref: str) -> NodeOut:
    with ctx.db.read() as session:
        node = _find_node(session, ref)
        return _node_out(node, _allocated_gpus(session).get(node.id, 0))


def set_cordoned(ctx: ServiceContext, caller: Principal, ref: str, cordoned: bool) -> NodeOut:
    caller.require_admin()
    with ctx.db.transaction() as session:
        node = _find_node(session, ref)
        if node.cordoned != cordoned:
            node.cordoned = cordoned
            node.version += 1
            if not cordoned:
                retry_unschedulable(session)
        return _node_out(node, _allocated_gpus(session).get(node.id, 0))


def expire_leases(ctx: ServiceContext) -> list[str]:
    """Mark nodes whose lease lapsed ``Lost``; their pods ``Lost``, requeued per policy.

    Returns the names of the nodes it marked. Guarded by ``version`` so a renewal that
    lands first wins.
    """
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        expired = session.execute(
            select(NodeModel.id, NodeModel.name, NodeModel.version).where(
                NodeModel.status == NodeStatus.READY.value, NodeModel.lease_expires_at <= now
            )
        ).all()
    lost = []
    for node_id, name, version in expired:
        with ctx.db.transaction() as session:
            marked = rows_changed(session,
                update(NodeModel)
                .where(NodeModel.id == node_id, NodeModel.version == version,
                       NodeModel.lease_expires_at <= now)
                .values(status=NodeStatus.LOST.value, version=NodeModel.version + 1,
                        assignments_revision=NodeModel.assignments_revision + 1),
            )
            if marked:
                _lose_pods(session, node_id, name, now)
                lost.append(name)
    return lost


def _lose_pods(session: Session, node_id: str, node_name: str,
               now: datetime) -> None:
    pods = session.scalars(
        select(PodModel).where(PodModel.node_id == node_id, PodModel.phase.in_(ACTIVE_PHASE_VALUES))
    ).all()
    for pod in pods:
        transition(session, pod, PodPhase.LOST, now, "NodeLost",
                   f"node {node_name} stopped renewing its lease")
        pod.finished_at = now
        if pod.deleted_at is None and pod.desired_state == "running" and should_restart(
            RestartPolicy(pod.restart_policy), PodPhase.LOST
        ):
            requeue(session, pod, now, "Rescheduling", f"node {node_name} was lost")
            pod.restart_count += 1
