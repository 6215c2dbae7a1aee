"""Project quotas: what an admin sets, and the ledger of GPU use the scheduling passes
check work against (see ``scheduler.quota``)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.core.errors import NotFound
from gpucloud.core.phases import ACTIVE_PHASE_VALUES, PodPhase
from gpucloud.core.policy import QuotaOut, QuotaSetRequest
from gpucloud.db.models import NodeModel, PodModel, ProjectModel, QuotaModel
from gpucloud.scheduler.quota import Ledger, Quota
from gpucloud.services import gpu_milli
from gpucloud.services.context import ServiceContext
from gpucloud.services.projects import Principal


def set_quota(ctx: ServiceContext, caller: Principal, project: str,
              request: QuotaSetRequest) -> QuotaOut:
    """Create or replace a project's quota (admin)."""
    caller.require_admin()
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        row = session.scalar(select(ProjectModel).where(
            (ProjectModel.name == project) | (ProjectModel.id == project)))
        if row is None:
            raise NotFound(f"project {project!r} not found")
        quota = session.get(QuotaModel, row.id, with_for_update=True)
        if quota is None:
            quota = QuotaModel(project_id=row.id)
            session.add(quota)
        quota.gpus, quota.borrow_limit, quota.updated_at = (
            dict(request.gpus), request.borrow_limit, now)
        session.flush()
        return _out(quota, row.name, load_ledger(session, now))


def list_quotas(ctx: ServiceContext, caller: Principal) -> list[QuotaOut]:
    """Every project's quota and use (admin); a project sees its own."""
    now = ctx.clock.now()
    with ctx.db.transaction() as session:
        query = (select(QuotaModel, ProjectModel.name)
                 .join(ProjectModel, ProjectModel.id == QuotaModel.project_id)
                 .order_by(ProjectModel.name))
        if not caller.is_admin:
            query = query.where(QuotaModel.project_id == caller.project_id)
        ledger = load_ledger(session, now)
        return [_out(quota, name, ledger) for quota, name in session.execute(query)]


def _out(quota: QuotaModel, name: str, ledger: Ledger) -> QuotaOut:
    used = {model: milli / 1000 for model, milli in ledger.used.get(quota.project_id, {}).items()
            if milli}
    return QuotaOut(project=name, gpus=dict(quota.gpus), borrow_limit=quota.borrow_limit,
                    used=used, updated_at=quota.updated_at)


def project_names(session: Session) -> dict[str, str]:
    return dict(session.execute(select(ProjectModel.id, ProjectModel.name)).all())


#: What a pod holds, for the ledger: (project, node id, GPU index -> milli pairs, CPU
#: milli, memory bytes).
Holding = tuple[str, str | None, Iterable[tuple[str, int]], int, int]


def load_ledger(session: Session, now: datetime,
                node_gpus: Iterable[tuple[str, list[dict[str, Any]]]] | None = None,
                holdings: Iterable[Holding] | None = None) -> Ledger:
    """The quotas, and what active pods and live reservations hold per project: GPUs per
    model (for quotas and DRF), CPU and memory (for DRF). ``node_gpus``: each node's id
    and GPUs when the caller has them already (a scheduling pass's snapshot), else read;
    ``holdings`` likewise, the active pods' and live reservations' (``Holding``)."""
    quotas = {q.project_id: Quota(dict(q.gpus), q.borrow_limit)
              for q in session.scalars(select(QuotaModel))}
    ledger = Ledger(quotas)
    models = _gpu_models(node_gpus if node_gpus is not None
                         else session.execute(select(NodeModel.id, NodeModel.gpus)))
    for project, node_id, pairs, cpu_milli, memory_bytes in (
            _holdings(session, now) if holdings is None else holdings):
        for index, milli in pairs:
            ledger.add(project, models.get((node_id or "", int(index)), "unknown"), milli)
        ledger.hold(project, cpu_milli, memory_bytes)
    return ledger


def _holdings(session: Session, now: datetime) -> list[Holding]:
    held = session.execute(
        select(PodModel.project_id, PodModel.node_id, gpu_milli.as_text(PodModel.gpu_milli),
               PodModel.cpu_milli, PodModel.memory_bytes)
        .where(PodModel.phase.in_(ACTIVE_PHASE_VALUES), PodModel.node_id.is_not(None))).all()
    reserved = session.execute(
        select(PodModel.project_id, PodModel.nominated_node_id,
               gpu_milli.as_text(PodModel.nominated_gpu_milli),
               PodModel.cpu_milli, PodModel.memory_bytes)
        .where(PodModel.phase == PodPhase.PENDING.value,
               PodModel.nominated_node_id.is_not(None),
               PodModel.nominated_until > now)).all()
    # (each JSON value parsed once)
    return [(project, node_id, gpu_milli.pairs(text), cpu, memory)
            for project, node_id, text, cpu, memory in [*held, *reserved]]


def _gpu_models(rows: Iterable[tuple[str, list[dict[str, Any]]]]) -> dict[tuple[str, int], str]:
    return {(node_id, gpu["index"]): gpu["model"] for node_id, gpus in rows for gpu in gpus}
