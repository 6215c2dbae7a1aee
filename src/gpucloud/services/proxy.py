"""What the HTTP proxy needs to know of a pod (read-only, cached for running pods).

The proxy reads this on every request, so a running pod's view is kept in the context's
short TTL cache: a pod that stops is refused by its agent at once and by the proxy
within the TTL; pods that are not running are never cached, so one that just started is
served at once.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from sqlalchemy import select

from gpucloud.core.phases import PodPhase
from gpucloud.db.models import PodModel
from gpucloud.services.context import ServiceContext

_CACHE_PREFIX = "proxy-pod:"


@dataclass(frozen=True)
class ProxyPod:
    pod_id: str
    name: str
    project_id: str
    phase: PodPhase
    #: The private ports declared ``N/http``.
    http_ports: frozenset[int]
    proxy_token: str | None


def http_ports(ports: list[str]) -> frozenset[int]:
    """``["8888/http", "22/tcp"]`` → ``{8888}``."""
    return frozenset(int(p.split("/", 1)[0]) for p in ports if p.endswith("/http"))


def cached_proxy_pod(ctx: ServiceContext, pod_id: str) -> ProxyPod | None:
    """The running pod's view if it was read in the last few seconds, without a query."""
    value = ctx.cache.get(_CACHE_PREFIX + pod_id)
    return value if isinstance(value, ProxyPod) else None


def proxy_pod(ctx: ServiceContext, pod_id: str) -> ProxyPod | None:
    """The live (not deleted) pod with this id in any project; the caller checks access."""
    cached = cached_proxy_pod(ctx, pod_id)
    if cached is not None:
        return cached
    with ctx.db.read() as session:
        row = session.execute(
            select(PodModel.id, PodModel.name, PodModel.project_id, PodModel.phase,
                   PodModel.ports, PodModel.proxy_token)
            .where(PodModel.id == pod_id, PodModel.deleted_at.is_(None))).one_or_none()
    if row is None:
        return None
    pod = ProxyPod(pod_id=row.id, name=row.name, project_id=row.project_id,
                   phase=PodPhase(row.phase), http_ports=http_ports(row.ports or []),
                   proxy_token=row.proxy_token)
    if pod.phase is PodPhase.RUNNING:
        ctx.cache.put(_CACHE_PREFIX + pod_id, pod)
    return pod


def new_proxy_token() -> str:
    """A pod's proxy token: a browser that brings it once gets it as a cookie. Kept in
    clear on the pod row because ``pod access`` shows it to the project again."""
    return secrets.token_urlsafe(32)
