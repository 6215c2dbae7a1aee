"""Admin GPU maintenance on the server side: ``gpucloud node gpu-reset NODE GPU`` and
``gpucloud node diag NODE [--gpu N]``.

A request is kept on the GPU's inventory entry (``maintenance``, state ``requested``); the
node's assignments carry it to the agent, which resets the GPU and/or runs the diag
(gpu/health) and reports the result with its next lease renewal. A passed result puts the
GPU back in service at once (the reset and the diag are the recovery the hysteresis of the
periodic checks waits for otherwise); a failed one keeps it out. A reset needs an idle GPU:
it is refused while pods hold that GPU.

A MIG mode switch (``node mig-mode NODE GPU --on|--off``, actions ``mig-on``/``mig-off``)
is the drain-time admin step of the issue: once asked, the GPU is out of scheduling
(``blocks_scheduling``); while pods still hold it the action is not handed to the agent,
until they end or ``drain_until`` passes (then it fails, ``expire``); with no wait it is
refused (409) while pods hold the GPU. The agent switches the mode (NVML
``nvmlDeviceSetMigMode``, a reset where the driver asks; the simulated provider flips its
state) and reports; a passed switch sets the inventory's ``mig_mode``, so placement
follows, and the GPU is back in scheduling.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.core.errors import Conflict, InvalidInput
from gpucloud.core.models import GpuAction, GpuActionKind, GpuActionResult, GpuMaintenance
from gpucloud.core.phases import ACTIVE_PHASE_VALUES
from gpucloud.db.models import NodeModel, PodModel
from gpucloud.services.context import new_id

MIG_ACTIONS = ("mig-on", "mig-off")


def request(node: NodeModel, action: GpuActionKind, gpu: int | None, level: int,
            now: datetime, busy: dict[int, list[str]], wait_seconds: float = 0) -> None:
    """Ask for ``action`` on GPU index ``gpu`` (None: every GPU, diag only) of ``node``.

    ``busy``: the pods holding each GPU index; a reset of a GPU pods hold is refused, and
    so is a MIG mode switch unless it may wait ``wait_seconds`` for them to end."""
    indexes = [g["index"] for g in node.gpus]
    if not indexes:
        raise InvalidInput("gpu", f"node {node.name} has no GPUs")
    if gpu is None and action != "diag":
        raise InvalidInput("gpu", f"a {action} names one GPU (its index)")
    if gpu is not None and gpu not in indexes:
        raise InvalidInput("gpu", f"node {node.name} has no GPU {gpu} (its GPUs: "
                           f"{', '.join(map(str, sorted(indexes)))})")
    targets = indexes if gpu is None else [gpu]
    drain_until = None
    if action in MIG_ACTIONS:
        drain_until = _check_mig_switch(node, targets[0], action, busy, now, wait_seconds)
    elif action == "reset" and busy.get(targets[0]):
        raise Conflict(f"GPU {targets[0]} of node {node.name} runs pods "
                       f"{', '.join(busy[targets[0]])}; stop or drain them first (a reset "
                       "needs an idle GPU)")
    gpus = []
    for entry in node.gpus:
        if entry["index"] in targets:
            entry = {**entry, "maintenance": GpuMaintenance(
                id=new_id(), action=action, level=level, requested_at=now,
                drain_until=drain_until).model_dump(mode="json")}
        gpus.append(entry)
    node.gpus = gpus


def _check_mig_switch(node: NodeModel, index: int, action: GpuActionKind,
                      busy: dict[int, list[str]], now: datetime,
                      wait_seconds: float) -> datetime | None:
    """Refuse a switch the GPU cannot take; the drain deadline when pods still hold it."""
    entry = next(g for g in node.gpus if g["index"] == index)
    if not entry.get("mig_capable"):
        raise InvalidInput("gpu", f"GPU {index} of node {node.name} ({entry['model']}) "
                           "does not support MIG")
    if bool(entry.get("mig_mode")) == (action == "mig-on"):
        raise Conflict(f"GPU {index} of node {node.name} already has MIG mode "
                       f"{'on' if action == 'mig-on' else 'off'}")
    pods = busy.get(index)
    if not pods:
        return None
    if wait_seconds <= 0:
        raise Conflict(f"GPU {index} of node {node.name} runs pods {', '.join(pods)}; "
                       "stop or drain them first, or give the switch time to wait for "
                       "them (a MIG mode switch needs an idle GPU)")
    return now + timedelta(seconds=wait_seconds)


def blocks_scheduling(entry: dict[str, Any]) -> bool:
    """Whether a GPU is out of scheduling for maintenance: a MIG mode switch asked for and
    not answered yet (nothing new is placed on a GPU being drained for it)."""
    found = _maintenance(entry)
    return found is not None and found.state == "requested" and found.action in MIG_ACTIONS


def busy_gpus(session: Session, node_id: str) -> dict[int, list[str]]:
    """Names of the active pods holding each GPU index of the node (MIG pods included:
    their ``gpu_milli`` names their GPU)."""
    return holders(session.execute(select(PodModel.name, PodModel.gpu_milli).where(
        PodModel.node_id == node_id, PodModel.phase.in_(ACTIVE_PHASE_VALUES))))


def holders(pods: Iterable[tuple[str, dict[str, int] | None]]) -> dict[int, list[str]]:
    """``busy_gpus`` from the (name, gpu_milli) of the node's active pods, already read."""
    held: dict[int, list[str]] = {}
    for name, gpu_milli in pods:
        for index in gpu_milli or {}:
            held.setdefault(int(index), []).append(name)
    return held


def expire(node: NodeModel, now: datetime, busy: dict[int, list[str]]) -> bool:
    """Fail the MIG switches whose drain deadline passed with pods still on the GPU (the
    GPU is back in scheduling, its mode unchanged). Returns whether anything changed."""
    changed = False
    gpus = []
    for entry in node.gpus:
        found = _maintenance(entry)
        if (found is not None and found.state == "requested" and found.drain_until is not None
                and found.drain_until <= now and busy.get(entry["index"])):
            failed = found.model_copy(update={
                "state": "failed", "finished_at": now,
                "output": f"pods still hold the GPU: {', '.join(busy[entry['index']])}"})
            entry = {**entry, "maintenance": failed.model_dump(mode="json")}
            changed = True
        gpus.append(entry)
    if changed:
        node.gpus = gpus
    return changed


def pending(node: NodeModel, busy: dict[int, list[str]] | None = None) -> list[GpuAction]:
    """The actions the agent still has to answer (it runs each id once); a MIG switch only
    once no pod holds its GPU (``busy``)."""
    out = []
    for entry in node.gpus:
        found = _maintenance(entry)
        if found is not None and found.action in MIG_ACTIONS and (busy or {}).get(
                entry["index"]):
            continue  # still draining
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
            if result.passed and found.action in MIG_ACTIONS:
                entry.update(mig_mode=found.action == "mig-on")
                if found.action == "mig-off":
                    entry.update(mig_instances=[])
            elif result.passed:
                entry.update(healthy=True, health_reason=None)
            changed = True
        gpus.append(entry)
    if changed:
        node.gpus = gpus
    return changed


def _maintenance(entry: dict[str, Any]) -> GpuMaintenance | None:
    raw = entry.get("maintenance")
    return GpuMaintenance.model_validate(raw) if raw else None
