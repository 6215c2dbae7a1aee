"""Which pod a user reaches, and whether it can be reached now (read-only queries).

The SSH gateway, the exec WebSocket and the HTTP proxy resolve a user's reference (a pod
id, the RunPod-style ``<pod-id>-<suffix>``, or a pod name) within one project, and get back
where the pod runs: the node's access endpoint and pinned host key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.core.access import PodAccessOut
from gpucloud.core.errors import Conflict, NotFound
from gpucloud.core.phases import PodPhase
from gpucloud.db.models import NodeModel, PodModel, SshKeyModel
from gpucloud.services.context import ServiceContext

#: ``<32 hex pod id>-<anything>``: RunPod's SSH user names (``{pod_id}-{machine suffix}``).
_ID_WITH_SUFFIX = re.compile(r"^([0-9a-f]{32})-.+$")
_WAITING = {PodPhase.PENDING, PodPhase.SCHEDULED, PodPhase.PULLING}


@dataclass(frozen=True)
class PodTarget:
    """A running pod as the access paths need it."""

    pod_id: str
    name: str
    project_id: str
    node_id: str | None
    phase: PodPhase
    endpoint: str | None
    host_key: str | None


def _lookup(session: Session, project_id: str, ref: str) -> PodModel | None:
    def find(value: str) -> PodModel | None:
        return session.scalar(select(PodModel).where(
            PodModel.project_id == project_id, PodModel.deleted_at.is_(None),
            (PodModel.id == value) | (PodModel.name == value)))

    pod = find(ref)
    match = _ID_WITH_SUFFIX.match(ref)
    if pod is None and match:
        pod = find(match.group(1))
    return pod


def unreachable_reason(name: str, phase: PodPhase) -> str:
    """The one line a user sees for a pod that is not running."""
    if phase in _WAITING:
        return f"pod {name} is {phase.value}; wait until it is Running (`gpucloud pod get {name}`)"
    return f"pod {name} is {phase.value}; start it with `gpucloud pod start {name}`"


def find_target(ctx: ServiceContext, project_id: str, ref: str) -> PodTarget:
    """The pod ``ref`` of the project whatever its phase; NotFound hides other projects."""
    with ctx.db.read() as session:
        pod = _lookup(session, project_id, ref)
        if pod is None:
            raise NotFound(f"pod {ref!r} not found")
        node = session.get(NodeModel, pod.node_id) if pod.node_id else None
        return PodTarget(pod_id=pod.id, name=pod.name, project_id=pod.project_id,
                         node_id=pod.node_id, phase=PodPhase(pod.phase),
                         endpoint=node.access_endpoint if node else None,
                         host_key=node.access_host_key if node else None)


def check_reachable(target: PodTarget) -> PodTarget:
    """``target`` if it runs on a node with an access server; Conflict (one line) if not."""
    if target.phase is not PodPhase.RUNNING:
        raise Conflict(unreachable_reason(target.name, target.phase))
    if not target.endpoint or not target.host_key:
        raise Conflict(f"pod {target.name} runs on a node without an access server; "
                       "upgrade and restart its agent")
    return target


def pod_target(ctx: ServiceContext, project_id: str, ref: str) -> PodTarget:
    """The running pod ``ref`` of the project (NotFound / Conflict otherwise)."""
    return check_reachable(find_target(ctx, project_id, ref))


def running_target(ctx: ServiceContext, pod_id: str) -> PodTarget:
    """The running pod with this id, in whatever project (the caller checked access)."""
    with ctx.db.read() as session:
        project_id = session.scalar(select(PodModel.project_id).where(
            PodModel.id == pod_id, PodModel.deleted_at.is_(None)))
    if project_id is None:
        raise NotFound(f"pod {pod_id!r} not found")
    return pod_target(ctx, project_id, pod_id)


def projects_with_key(ctx: ServiceContext, fingerprint: str) -> list[str]:
    """The projects that hold this SSH key (SHA256 fingerprint), oldest first."""
    with ctx.db.read() as session:
        return list(session.scalars(select(SshKeyModel.project_id)
                                    .where(SshKeyModel.fingerprint == fingerprint)
                                    .order_by(SshKeyModel.created_at)))


def ssh_login(ctx: ServiceContext, username: str, fingerprint: str) -> PodTarget | None:
    """The pod an SSH login as ``username`` with this key reaches, whatever its phase;
    None when no project holding the key has such a pod (the key never reaches a pod of a
    project it is not in)."""
    for project_id in projects_with_key(ctx, fingerprint):
        try:
            return find_target(ctx, project_id, username)
        except NotFound:
            continue
    return None


@dataclass(frozen=True)
class AccessPoints:
    """Where users reach the server: the host they called it by, the API's port and the
    SSH gateway's (None without a gateway)."""

    host: str
    api_port: int | None
    ssh_port: int | None


def http_ports(ports: list[str]) -> list[int]:
    """The ``N/http`` ports of a spec, in order."""
    return [int(p.split("/")[0]) for p in ports if p.endswith("/http")]


def proxy_url(pod_id: str, port: int, domain: str, api_port: int | None) -> str:
    """RunPod's host form: ``http://{pod-id}-{port}.{domain}[:{server port}]/``."""
    suffix = f":{api_port}" if api_port and api_port != 80 else ""
    return f"http://{pod_id}-{port}.{domain}{suffix}/"


def pod_access(ctx: ServiceContext, project_id: str, ref: str,
               points: AccessPoints) -> PodAccessOut:
    """How to reach the pod: the exact ``ssh`` command and its HTTP ports' proxy URLs."""
    with ctx.db.read() as session:
        pod = _lookup(session, project_id, ref)
        if pod is None:
            raise NotFound(f"pod {ref!r} not found")
        pod_id, ports, token = pod.id, list(pod.ports), pod.proxy_token
    command = (f"ssh -p {points.ssh_port} {pod_id}@{points.host}"
               if points.ssh_port else "")
    http = {str(port): proxy_url(pod_id, port, ctx.settings.proxy_domain, points.api_port)
            for port in http_ports(ports)}
    return PodAccessOut(pod_id=pod_id, ssh_user=pod_id, ssh_host=points.host,
                        ssh_port=points.ssh_port or 0, ssh_command=command, http=http,
                        proxy_token=token)
