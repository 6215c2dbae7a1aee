"""What the scheduler needs to know about GPU sharing beyond milli-GPU: the memory limits
of the shares on each GPU (MPS limits add up per GPU) and the MIG facts of each GPU as the
node reports them (MIG mode, and under a fixed policy the node's own layout)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.core.phases import ACTIVE_PHASE_VALUES
from gpucloud.db.models import NodeModel, PodModel
from gpucloud.services.mig import mig_policy

MiB = 1024 * 1024


def share_memory_held(session: Session) -> dict[str, dict[int, int]]:
    """node id -> GPU index -> MiB of device memory the limits of its active shares take
    (a share without a limit promises none; whole GPUs and MIG pods are not shares)."""
    rows = session.execute(
        select(PodModel.node_id, PodModel.gpu_milli, PodModel.gpu_memory_bytes)
        .where(PodModel.phase.in_(ACTIVE_PHASE_VALUES), PodModel.node_id.is_not(None),
               PodModel.gpu_memory_bytes.is_not(None), PodModel.mig_profile.is_(None))
    ).all()
    return share_memory_of(rows)


def share_memory_of(rows: Iterable[tuple[str | None, Iterable[str] | None, int | None]]
                    ) -> dict[str, dict[int, int]]:
    """``share_memory_held`` of rows already read: (node id, GPU indexes, memory limit) of
    the active shares (a scheduling pass reads all its pods' holdings at once)."""
    held: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for node_id, indexes, memory in rows:
        if node_id is None or not memory:
            continue
        for index in indexes or ():
            held[node_id][int(index)] += -(-int(memory) // MiB)  # whole MiB, rounded up
    return held


def mig_facts(node: NodeModel, gpu: dict[str, Any]) -> dict[str, Any]:
    """``GpuState`` fields of one inventory GPU: its MIG mode, and its layout when the node's
    policy is fixed ((profile, start) of each instance it advertises; None: dynamic)."""
    layout = None
    if mig_policy(node) == "fixed":
        layout = tuple((str(m["profile"]), int(m["slot"])) for m in gpu.get("mig_instances") or ())
    return {"mig_mode": bool(gpu.get("mig_mode", False)), "mig_layout": layout}
