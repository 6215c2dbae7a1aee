"""Admin GPU maintenance on the server side: ``gpucloud node gpu-reset NODE GPU`` and
``gpucloud node diag NODE [--gpu N]``.

A request is kept on the GPU's inventory entry (``maintenance``, state ``requested``); the
node's assignments carry it to the agent, which resets the GPU and/or runs the diag
(gpu/health) and reports the result with its next lease renewal. A passed result puts the
GPU back in service at once (the reset and the diag are the recovery the hysteresis of the
periodic checks waits for otherwise); a failed one keeps it out. A reset needs an idle GPU:
it is refused while pods hold that GPU.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from gpucloud.core.errors import Conflict, InvalidInput
from gpucloud.core.models import GpuAction, GpuActionKind, GpuActionResult, GpuMaintenance
from gpucloud.db.models import NodeModel
from gpucloud.services.context import new_id


def request(node: NodeModel, action: GpuActionKind, gpu: int | None, level: int,
            now: datetime, busy: dict[int, list[str]]) -> None:
    """Ask for ``action`` on GPU index ``gpu`` (None: every GPU, diag only) of ``node``.

    ``busy``: the pods holding each GPU index; a reset of a GPU pods hold is refused."""
    indexes = [g["index"] for g in node.gpus]
    if not indexes:
        raise InvalidInput("gpu", f"node {node.name} has no GPUs")
    if gpu is None and action == "reset":
        raise InvalidInput("gpu", "a reset names one GPU (its index)")
    if gpu is not None and gpu not in indexes:
        raise InvalidInput("gpu", f"node {node.name} has no GPU {gpu} (its GPUs: "
                           f"{', '.join(map(str, sorted(indexes)))})")
    targets = indexes if gpu is None else [gpu]
    if action == "reset" and busy.get(targets[0]):
        raise Conflict(f"GPU {targets[0]} of node {node.name} runs pods "
                       f"{', '.join(busy[targets[0]])}; stop or drain them first (a reset "
                       "needs an idle GPU)")
    gpus = []
    for entry in node.gpus:
        if entry["index"] in targets:
            entry = {**entry, "maintenance": GpuMaintenance(
                id=new_id(), action=action, level=level, requested_at=now).model_dump(
                    mode="json")}
        gpus.append(entry)
    node.gpus = gpus


def pending(node: NodeModel) -> list[GpuAction]:
    """The actions the agent still has to answer (it runs each id once)."""
    out = []
    for entry in node.gpus:
        found = _maintenance(entry)
        if found is not None and found.state == "requested":
            out.append(GpuAction(id=found.id, gpu_uuid=entry["uuid"], gpu_index=entry["index"],
                                 action=found.action, level=found.level))
    return out


def apply_results(node: NodeModel, results: list[GpuActionResult], now: datetime) -> bool:
    """Record the agent's results of requested actions (others are stale repeats: ignored);
    a passed one puts its GPU back in service. Returns whether anything changed."""
    by_id = {r.id: r for r in results}
    changed = False
    gpus = []
    for entry in node.gpus:
        found = _maintenance(entry)
        result = by_id.get(found.id) if found is not None else None
        if found is not None and result is not None and found.state == "requested":
            done = found.model_copy(update={
                "state": "passed" if result.passed else "failed", "finished_at": now,
                "output": result.output})
            entry = {**entry, "maintenance": done.model_dump(mode="json")}
            if result.passed:
                entry.update(healthy=True, health_reason=None)
            changed = True
        gpus.append(entry)
    if changed:
        node.gpus = gpus
    return changed


def _maintenance(entry: dict[str, Any]) -> GpuMaintenance | None:
    raw = entry.get("maintenance")
    return GpuMaintenance.model_validate(raw) if raw else None
