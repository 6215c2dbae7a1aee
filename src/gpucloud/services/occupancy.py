"""What holds each GPU of the fleet right now (the console's GPU grid and free capacity).

A read of the active pods' allocations: whole GPUs (``gpu_uuids``), shares (a pod asking
for less than one GPU: ``gpus`` × 1000 milli-GPU of its one UUID) and MIG devices
(``mig_device``: parent UUID, profile, start slot). Pods of other projects are counted
but not named to a non-admin caller."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sqlalchemy import select

from gpucloud.core.phases import ACTIVE_PHASE_VALUES
from gpucloud.db.models import PodModel
from gpucloud.services.context import ServiceContext
from gpucloud.services.projects import Principal

HIDDEN = "another project's pod"
_MIG_SLICES = re.compile(r"^(\d+)g\.")


@dataclass
class MigUse:
    slot: int
    slices: int
    profile: str
    pod: str


@dataclass
class GpuUse:
    """One GPU's holders: a whole-GPU pod, shares (milli-GPU by pod) or MIG devices."""

    whole: str | None = None
    shares: dict[str, int] = field(default_factory=dict)
    mig: list[MigUse] = field(default_factory=list)

    @property
    def free(self) -> bool:
        return self.whole is None and not self.shares and not self.mig

    @property
    def milli_used(self) -> int:
        return sum(self.shares.values())


def mig_slices(profile: str) -> int:
    """Compute slices of a MIG profile (``3g.40gb`` → 3); 1 when the name is unusual."""
    match = _MIG_SLICES.match(profile)
    return int(match.group(1)) if match else 1


def gpu_occupancy(ctx: ServiceContext, caller: Principal) -> dict[str, dict[str, GpuUse]]:
    """Node id → GPU UUID → its holders, for every GPU some active pod holds."""
    with ctx.db.read() as session:
        rows = session.execute(
            select(PodModel.node_id, PodModel.project_id, PodModel.name, PodModel.gpu_uuids,
                   PodModel.gpus, PodModel.mig_device)
            .where(PodModel.phase.in_(ACTIVE_PHASE_VALUES), PodModel.node_id.is_not(None))
        ).all()
    grid: dict[str, dict[str, GpuUse]] = {}
    for node_id, project_id, name, uuids, gpus_asked, mig in rows:
        shown = name if caller.is_admin or project_id == caller.project_id else HIDDEN
        gpus = grid.setdefault(node_id, {})
        if mig:
            profile = str(mig.get("profile", ""))
            use = gpus.setdefault(str(mig.get("gpu_uuid")), GpuUse())
            use.mig.append(MigUse(int(mig.get("slot") or 0), mig_slices(profile), profile,
                                  shown))
        elif 0 < (gpus_asked or 0) < 1:
            for uuid in uuids or []:
                use = gpus.setdefault(uuid, GpuUse())
                use.shares[shown] = use.shares.get(shown, 0) + round(gpus_asked * 1000)
        else:
            for uuid in uuids or []:
                gpus.setdefault(uuid, GpuUse()).whole = shown
    return grid
