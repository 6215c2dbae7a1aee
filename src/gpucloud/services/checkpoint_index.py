"""Which checkpoints a pod has: the queries that pods, assignments and the checkpoint
service share (kept apart from services.checkpoints, which imports the node service)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import and_, bindparam, or_, select
from sqlalchemy.orm import Session

from gpucloud.core.capabilities import CHECKPOINT_TRANSPARENT
from gpucloud.core.checkpoint_interval import COST_SAMPLES
from gpucloud.core.checkpoints import CheckpointSummary
from gpucloud.core.models import AssignmentOut
from gpucloud.db.models import CheckpointModel, PodModel

COMMITTED, CORRUPT = "committed", "corrupt"


def keeps_checkpoints(pod: PodModel) -> bool:
    """A checkpoint directory, or transparent checkpoints (CRIU dumps, filed the same way
    under the same key: the dump directory is what is uploaded and restored)."""
    return pod.checkpoint_dir is not None or pod.checkpoint_mode == CHECKPOINT_TRANSPARENT


def checkpoint_key(pod: PodModel) -> str:
    """The pod id; a job's member files under ``<job id>-<rank>`` (its rank's state)."""
    return f"{pod.job_id}-{pod.rank}" if pod.job_id is not None else pod.id


def checkpoint_rows(session: Session, project_id: str, key: str, state: str | None = None,
                    limit: int | None = None) -> list[CheckpointModel]:
    """The key's checkpoints, newest first (attempt, then sequence number)."""
    query = select(CheckpointModel).where(CheckpointModel.project_id == project_id,
                                          CheckpointModel.key == key)
    if state is not None:
        query = query.where(CheckpointModel.state == state)
    query = query.order_by(CheckpointModel.attempt.desc(), CheckpointModel.seq.desc())
    return list(session.scalars(query.limit(limit) if limit else query))


def restore_target(session: Session, pod: PodModel) -> str | None:
    """The checkpoint a start of ``pod`` restores: its latest committed one."""
    if not keeps_checkpoints(pod):
        return None
    rows = checkpoint_rows(session, pod.project_id, checkpoint_key(pod), COMMITTED, limit=1)
    return rows[0].id if rows else None


def last_checkpoint(session: Session, pod: PodModel) -> CheckpointSummary | None:
    if not keeps_checkpoints(pod):
        return None
    rows = checkpoint_rows(session, pod.project_id, checkpoint_key(pod), COMMITTED, limit=1)
    if not rows:
        return None
    return CheckpointSummary(id=rows[0].id, time=rows[0].created_at,
                             size_bytes=rows[0].size_bytes)


@dataclass
class NodeCheckpoints:
    """The checkpoints an answer's pods need, read at once (``read_for``): the latest
    committed one of each key, and the measured costs of each pod's checkpoints."""

    latest: dict[tuple[str, str], tuple[int, int, str]] = field(default_factory=dict)
    costs_of: dict[str, list[tuple[datetime, float]]] = field(default_factory=dict)

    def restore_target(self, pod: PodModel) -> str | None:
        """``restore_target`` of the module, from what was read."""
        if not keeps_checkpoints(pod):
            return None
        found = self.latest.get((pod.project_id, checkpoint_key(pod)))
        return found[2] if found is not None else None

    def costs(self, pod: PodModel) -> list[float]:
        """The pod's last ``COST_SAMPLES`` measured costs, oldest first."""
        newest = sorted(self.costs_of.get(pod.id, []), key=lambda found: found[0],
                        reverse=True)[:COST_SAMPLES]
        return [cost for _, cost in reversed(newest)]


#: ``read_for``'s query, built once.
_FOR_PODS = select(
    CheckpointModel.id, CheckpointModel.project_id, CheckpointModel.key,
    CheckpointModel.pod_id, CheckpointModel.state, CheckpointModel.attempt,
    CheckpointModel.seq, CheckpointModel.cost_seconds, CheckpointModel.created_at,
).where(or_(
    and_(CheckpointModel.project_id.in_(bindparam("projects", expanding=True)),
         CheckpointModel.key.in_(bindparam("keys", expanding=True)),
         CheckpointModel.state == COMMITTED),
    and_(CheckpointModel.pod_id.in_(bindparam("pods", expanding=True)),
         CheckpointModel.cost_seconds.is_not(None))))


def read_for(session: Session, pods: Iterable[PodModel]) -> NodeCheckpoints:
    """One query for all ``pods`` that keep checkpoints (none when no pod does): their
    keys' committed checkpoints (retention bounds them) and their own measured costs."""
    keeping = [pod for pod in pods if keeps_checkpoints(pod)]
    out = NodeCheckpoints()
    if not keeping:
        return out
    keys = {(pod.project_id, checkpoint_key(pod)) for pod in keeping}
    pod_ids = {pod.id for pod in keeping}
    rows = session.execute(_FOR_PODS, {
        "projects": sorted({project for project, _ in keys}),
        "keys": sorted({key for _, key in keys}), "pods": sorted(pod_ids)})
    for id_, project, key, pod_id, state, attempt, seq, cost, created_at in rows:
        if state == COMMITTED and (project, key) in keys and (
                out.latest.get((project, key), (-1, -1, ""))[:2] < (attempt, seq)):
            out.latest[(project, key)] = (attempt, seq, id_)
        if pod_id in pod_ids and cost is not None:
            out.costs_of.setdefault(pod_id, []).append((created_at, float(cost)))
    return out


def add_to_assignment(pod: PodModel, assignment: AssignmentOut,
                      found: NodeCheckpoints) -> None:
    """The checkpoint directory (None for a transparent pod: the agent dumps the
    container), its key and the checkpoint to restore before the start."""
    if not keeps_checkpoints(pod):
        return
    assignment.checkpoint_dir = pod.checkpoint_dir
    assignment.checkpoint_key = checkpoint_key(pod)
    assignment.restore_checkpoint = found.restore_target(pod)
