"""The meter: one ``pod_runs`` row per pod attempt's ``Running`` interval.

``on_transition`` (called by ``services.events.transition`` for every phase change) opens
the attempt's row when it enters ``Running`` and closes it when it leaves. Billed seconds
are ``ended_at - started_at``, decided by these transitions, never by sample counts:

* pulling is not billed (the row opens at ``Running``);
* the stop grace is billed (the pod stays Running until its container has ended);
* an attempt on a node declared ``Lost`` ends at the node's last lease renewal
  (``nodes.lease_renewed_at``), not when the loss was noticed;
* an attempt ended by a GPU hardware fault (reason in ``core.usage.CREDITED_REASONS``)
  is marked ``credited``.

The run's GPU model is the model of the GPUs the attempt was given (the node's, in its
catalog name), not only the one the pod asked for: a pod that names none would otherwise
be priced at no model, i.e. $0. A MIG pod's run keeps its profile (priced per profile).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from gpucloud.core.gpu_models import canonical_name
from gpucloud.core.phases import PodPhase
from gpucloud.core.usage import CREDITED_REASONS
from gpucloud.db.models import NodeModel, PodModel, PodRunModel


def on_transition(session: Session, pod: PodModel, current: PodPhase, target: PodPhase,
                  now: datetime, reason: str) -> None:
    """Open the attempt's run when it starts Running; close it when it leaves Running."""
    if target is PodPhase.RUNNING and current is not PodPhase.RUNNING:
        open_run(session, pod, now)
    elif current is PodPhase.RUNNING and target is not PodPhase.RUNNING:
        close_run(session, pod, now, reason, lost=target is PodPhase.LOST)


def open_run(session: Session, pod: PodModel, now: datetime) -> None:
    """The attempt's allocation, copied as it starts (idempotent per attempt)."""
    if session.get(PodRunModel, (pod.id, pod.attempt)) is not None:
        return
    milli = sum(pod.gpu_milli.values()) if pod.gpu_milli else 0
    session.add(PodRunModel(
        pod_id=pod.id, attempt=pod.attempt, project_id=pod.project_id, job_id=pod.job_id,
        node_id=pod.node_id, gpu_type=_model_given(session, pod), gpus=float(pod.gpus),
        gpu_milli=milli if milli else round(pod.gpus * 1000), mig_profile=pod.mig_profile,
        cpu_milli=pod.cpu_milli, memory_bytes=pod.memory_bytes,
        volume_bytes=pod.volume_bytes or 0, priority_class=pod.priority_class,
        spot=bool(pod.spot), started_at=now, ended_at=None, end_reason=None, credited=False))


def _model_given(session: Session, pod: PodModel) -> str | None:
    """The catalog name of the model of the pod's first GPU on its node, else the model
    the pod asked for (None: a CPU-only pod, or a node that reports no model)."""
    if pod.node_id and pod.gpu_uuids:
        node = session.get(NodeModel, pod.node_id)
        for gpu in node.gpus if node is not None else []:
            if gpu.get("uuid") == pod.gpu_uuids[0] and gpu.get("model"):
                return canonical_name(str(gpu["model"]))
    return pod.gpu_type


def close_run(session: Session, pod: PodModel, now: datetime, reason: str,
              lost: bool = False) -> None:
    """End the attempt's open run at ``now`` — at the node's last lease renewal when the
    node was lost (never before the run started)."""
    run = session.get(PodRunModel, (pod.id, pod.attempt))
    if run is None or run.ended_at is not None:
        return
    end = now
    if lost and run.node_id is not None:
        node = session.get(NodeModel, run.node_id)
        renewed = node.lease_renewed_at if node is not None else None
        if renewed is not None:
            end = max(run.started_at, min(now, renewed))
    run.ended_at, run.end_reason = end, reason
    run.credited = reason in CREDITED_REASONS
