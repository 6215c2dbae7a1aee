"""MIG on the server side: the slots MIG pods hold, the node's MIG policy, and the MIG
device a node reports for a pod.

The scheduler's placement rules (``scheduler.mig``) decide a MIG pod's GPU and start slot;
the bind stores the slot on the pod (``mig_slot``), every later snapshot counts the memory
slices it covers as taken, and the assignment carries it to the agent, which creates the
instance exactly there (dynamic mode) or uses the one it has there (fixed mode).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpucloud.core.errors import InvalidInput
from gpucloud.core.gpu_models import canonical_name
from gpucloud.core.models import MigDevice
from gpucloud.core.phases import ACTIVE_PHASE_VALUES, PodPhase
from gpucloud.db.models import NodeModel, PodModel
from gpucloud.scheduler.mig import geometry
from gpucloud.scheduler.plugins.filters import MIG_POLICY_LABEL as FILTER_LABEL

MIG_POLICIES = ("dynamic", "fixed", "off")
DEFAULT_MIG_POLICY = "dynamic"
#: The label that tells the scheduler a node takes no MIG pods (``plugins.filters``).
MIG_POLICY_LABEL = FILTER_LABEL


@dataclass(frozen=True)
class MigHeld:
    """A MIG instance an active pod (or a bound one) holds: GPU index, profile, start;
    ``reserved``: held by a preemption's reservation for a pending pod instead."""

    gpu_index: int
    profile: str
    slot: int
    reserved: bool = False


def mig_held(session: Session, now: datetime) -> dict[str, list[MigHeld]]:
    """The MIG instances of active pods, and the slots live preemption reservations hold
    for pending MIG pods (services/preemption), by node id: a reserved slot is taken for
    everyone else while its preemptor waits for the victims to leave, as a reservation's
    GPU share is in the usage (``scheduling._held``)."""
    active = session.execute(
        select(PodModel.node_id, PodModel.gpu_milli, PodModel.mig_profile, PodModel.mig_slot)
        .where(PodModel.phase.in_(ACTIVE_PHASE_VALUES), PodModel.node_id.is_not(None),
               PodModel.mig_profile.is_not(None), PodModel.mig_slot.is_not(None))
    ).all()
    reserved = session.execute(
        select(PodModel.nominated_node_id, PodModel.nominated_gpu_milli,
               PodModel.mig_profile, PodModel.mig_slot)
        .where(PodModel.phase == PodPhase.PENDING.value,
               PodModel.nominated_node_id.is_not(None), PodModel.nominated_until > now,
               PodModel.mig_profile.is_not(None), PodModel.mig_slot.is_not(None))
    ).all()
    return held_of([(*row, False) for row in active] + [(*row, True) for row in reserved])


def held_of(rows: Iterable[tuple[str | None, Iterable[str] | None, str | None, int | None,
                                 bool]]) -> dict[str, list[MigHeld]]:
    """``mig_held`` of rows already read: (node id, its GPU indexes, MIG profile, slot,
    whether it is a reservation) (a scheduling pass reads all its pods' holdings at once)."""
    held: dict[str, list[MigHeld]] = defaultdict(list)
    for node_id, indexes, profile, slot, is_reserved in rows:
        if node_id is None or profile is None or slot is None:
            continue
        for index in indexes or ():
            held[node_id].append(MigHeld(int(index), profile, int(slot), is_reserved))
    return held


def mig_slots(gpus: list[dict[str, Any]], held: list[MigHeld]) -> dict[int, tuple[int, ...]]:
    """The memory slices taken per GPU index (the geometry of each profile on that GPU's
    model); a profile the model lacks takes the whole GPU rather than none."""
    models = {g["index"]: canonical_name(g["model"]) for g in gpus}
    taken: dict[int, set[int]] = defaultdict(set)
    for item in held:
        geom = geometry(models.get(item.gpu_index, ""), item.profile)
        size = geom.size if geom is not None else 8
        taken[item.gpu_index].update(range(item.slot, min(8, item.slot + size)))
    return {index: tuple(sorted(slots)) for index, slots in taken.items()}


def slots_free(gpus: list[dict[str, Any]], held: list[MigHeld], wanted: list[MigHeld]) -> bool:
    """Whether no active pod's instance (reservations aside) covers a slice of ``wanted``:
    a MIG preemptor binds onto its reservation only once its victims have left it (their
    compute shares can add up to less than a GPU while their slices still overlap)."""
    taken = mig_slots(gpus, [item for item in held if not item.reserved])
    mine = mig_slots(gpus, wanted)
    return all(not set(taken.get(index, ())) & set(slices) for index, slices in mine.items())


def mig_policy(node: NodeModel) -> str:
    return node.mig_policy or DEFAULT_MIG_POLICY


def mig_labels(node: NodeModel, labels: dict[str, str]) -> dict[str, str]:
    """The scheduler's labels of a node, with its MIG policy when that is not dynamic."""
    policy = mig_policy(node)
    return labels if policy == DEFAULT_MIG_POLICY else {**labels, MIG_POLICY_LABEL: policy}


def check_policy(mode: str) -> str:
    if mode not in MIG_POLICIES:
        raise InvalidInput("mode", f"{mode!r} is not one of {', '.join(MIG_POLICIES)}")
    return mode


def device_out(pod: PodModel) -> MigDevice | None:
    """The MIG device the node reported for a pod (None: not MIG, or not reported yet)."""
    return MigDevice.model_validate(pod.mig_device) if pod.mig_device else None


def record_device(pod: PodModel, phase: PodPhase, device: MigDevice | None) -> None:
    """Keep the MIG device a node reports with ``Running``; refuse one that is not where
    the scheduler put the pod (that would be a node-side bug worth a loud 422)."""
    if device is None or pod.mig_profile is None:
        return
    if device.slot != pod.mig_slot or device.profile != pod.mig_profile or (
            pod.gpu_uuids and device.gpu_uuid != pod.gpu_uuids[0]):
        raise InvalidInput("mig_device", f"MIG device {device.mig_uuid} is "
                           f"{device.profile} at slot {device.slot} of {device.gpu_uuid}, "
                           f"not where the pod was scheduled (slot {pod.mig_slot})")
    if phase is PodPhase.RUNNING or pod.mig_device is None:
        pod.mig_device = device.model_dump()
