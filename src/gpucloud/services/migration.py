"""Moving a stopped pod's volume disk to another node: ``pod start --migrate``.

The database says where the disk is. ``volume_node_id`` pins a pod to the node holding it;
``pod start --migrate`` un-pins it and records that node as ``volume_source_node_id``. While
that is set the source is authoritative: it keeps its copy (its ``volume_pods`` still name
the pod) and, once the pod is bound elsewhere, lets exactly that destination fetch it
(``AssignmentsOut.volume_exports`` names the destination's access host key). The
destination's assignment names the source (``AssignmentOut.volume_source``: endpoint and
host key); its agent copies the disk over SSH, checks the stream's sha256, and reports.
A success moves the pin to the destination and clears the source, whose agent then deletes
its copy; a failure pins the pod back to the source. Nothing secret is stored: the nodes
authenticate each other with the host keys they registered.
"""

from __future__ import annotations

from datetime import datetime
from functools import partial

from sqlalchemy import bindparam, or_, select, update
from sqlalchemy.orm import Session, aliased

from gpucloud.core.errors import Conflict, InvalidInput
from gpucloud.core.models import VolumeExport, VolumeMigrationReport, VolumeSource
from gpucloud.core.phases import ACTIVE_PHASE_VALUES, NodeStatus
from gpucloud.core.quantities import format_memory
from gpucloud.db.models import NodeModel, PodModel
from gpucloud.db.session import on_commit
from gpucloud.services import wakeups
from gpucloud.services.events import record_event

FIELD = "migrate"


def _wake(session: Session, node_id: str) -> None:
    """The node's assignments changed (its volume pods or exports): wake its agent."""
    session.execute(update(NodeModel).where(NodeModel.id == node_id)
                    .values(assignments_revision=NodeModel.assignments_revision + 1))
    on_commit(session, partial(wakeups.ASSIGNMENTS.notify, node_id))


def prepare_start(session: Session, pod: PodModel, migrate: bool) -> None:
    """Where a pod starting again may go. Without ``migrate``, an unfinished migration is
    forgotten: the pod goes back to the node that still holds its disk. With it, the pod
    is un-pinned and that node becomes the copy's source (it must be Ready: a Lost node
    cannot hand its disk over)."""
    if not migrate:
        if pod.volume_source_node_id is not None:
            pod.volume_node_id, pod.volume_source_node_id = pod.volume_source_node_id, None
        return
    if pod.volume_bytes is None:
        raise InvalidInput(FIELD, "the pod has no volume disk to move")
    source_id = pod.volume_source_node_id or pod.volume_node_id
    if source_id is None:
        return  # never placed: nothing to copy, it starts anywhere
    source = session.get_one(NodeModel, source_id)
    if source.status != NodeStatus.READY.value:
        raise Conflict(f"the volume is on {source.status.lower()} node {source.name}: it "
                       "cannot be copied until that node is back (`pod start --gpus 0` "
                       "won't help either)")
    if not source.access_endpoint or not source.access_host_key:
        raise Conflict(f"node {source.name} runs no access server to copy the volume from")
    pod.volume_source_node_id, pod.volume_node_id = source_id, None


def on_bind(session: Session, pod_id: str, node_id: str) -> None:
    """A migrating pod was bound: back on its source there is nothing to copy; elsewhere
    the source learns at once that this destination may fetch the disk."""
    source_id = session.scalar(select(PodModel.volume_source_node_id)
                               .where(PodModel.id == pod_id))
    if source_id is None:
        return
    if source_id == node_id:
        session.execute(update(PodModel).where(PodModel.id == pod_id)
                        .values(volume_source_node_id=None))
    else:
        _wake(session, source_id)


def volume_source(pod: PodModel, node: NodeModel, source: str | None,
                  endpoint: str | None, host_key: str | None) -> VolumeSource | None:
    """For the destination's assignment: where to fetch the disk from, if it must (the
    name, access endpoint and host key of the node ``pod.volume_source_node_id`` names,
    read with the pod)."""
    if pod.volume_source_node_id is None or pod.volume_source_node_id == node.id:
        return None
    if source is None or not endpoint or not host_key:
        return None
    return VolumeSource(node=source, endpoint=endpoint, host_key=host_key)


_DESTINATION = aliased(NodeModel, name="destination")
_IS_SOURCE = PodModel.volume_source_node_id == bindparam("node_id")
#: ``node_volumes``' query, built once (every bind runs it).
_NODE_VOLUMES = (
    select(PodModel.id, PodModel.volume_bytes, PodModel.volume_source_node_id,
           PodModel.phase, _DESTINATION.name, _DESTINATION.access_host_key)
    .outerjoin(_DESTINATION, _DESTINATION.id == PodModel.node_id)
    .where(PodModel.deleted_at.is_(None),
           or_(PodModel.volume_node_id == bindparam("node_id"),
               PodModel.node_id == bindparam("node_id"), _IS_SOURCE),
           or_(PodModel.volume_bytes.is_not(None), _IS_SOURCE))
    .order_by(PodModel.id))


def node_volumes(session: Session, node_id: str) -> tuple[list[str], list[VolumeExport]]:
    """For the node's assignments, in one query: the live pods whose volume disk lives
    there (the agent keeps only their dirs: pinned there, bound there, or the source of
    a migration) and, of those it is the source of, the disks it may hand out now, each
    to the node its pod is bound to (only while that pod is active there)."""
    rows = session.execute(_NODE_VOLUMES, {"node_id": node_id}).all()
    kept = [pod_id for pod_id, volume_bytes, *_ in rows if volume_bytes is not None]
    exports = [VolumeExport(pod_id=pod_id, peer_node=name, peer_key=key)
               for pod_id, _, source_id, phase, name, key in rows
               if source_id == node_id and phase in ACTIVE_PHASE_VALUES
               and name is not None and key is not None]
    return kept, exports


def apply_report(session: Session, pod: PodModel, node: NodeModel,
                 report: VolumeMigrationReport, now: datetime) -> None:
    """The destination's word on the copy. Repeats (a retried report) change nothing."""
    source_id = pod.volume_source_node_id
    if source_id is None or source_id == node.id:
        return
    source = session.get(NodeModel, source_id)
    source_name = source.name if source is not None else report.source_node
    if report.error is None and report.sha256 is not None and report.size_bytes is not None:
        record_event(session, pod.id, now, "VolumeMigrated",
                     f"{format_memory(report.size_bytes)} ({report.size_bytes} bytes) copied "
                     f"from node {source_name} to {node.name}, sha256 {report.sha256}")
        pod.volume_node_id = node.id
    else:
        record_event(session, pod.id, now, "VolumeMigrationFailed",
                     report.error or "the copy was incomplete")
        pod.volume_node_id = source_id  # the disk is still there
    pod.volume_source_node_id = None
    _wake(session, source_id)  # it deletes its copy, or stops exporting it
