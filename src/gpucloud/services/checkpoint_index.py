"""Which checkpoints a pod has: the queries that pods, assignments and the checkpoint
service share (kept apart from services.checkpoints, which imports the node service)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.core.capabilities import CHECKPOINT_TRANSPARENT
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


def add_to_assignment(session: Session, pod: PodModel, assignment: AssignmentOut) -> None:
    """The checkpoint directory (None for a transparent pod: the agent dumps the
    container), its key and the checkpoint to restore before the start."""
    if not keeps_checkpoints(pod):
        return
    assignment.checkpoint_dir = pod.checkpoint_dir
    assignment.checkpoint_key = checkpoint_key(pod)
    assignment.restore_checkpoint = restore_target(session, pod)
