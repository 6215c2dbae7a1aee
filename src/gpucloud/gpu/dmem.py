"""cgroup v2 device-memory accounting (the ``dmem`` controller, Linux 6.14 and later).

Detected, never assumed: the controller must be listed in the root's
``cgroup.controllers`` and the GPU's driver must have registered a region for it in
``dmem.capacity`` (lines ``drm/<PCI bus id>/<region> <bytes>``, e.g.
``drm/0000:18:00.0/vram0 85899345920``). A pod's limit goes into the OCI config's
``linux.resources.unified`` as ``dmem.max`` — never for MIG devices, whose memory the GPU
itself partitions.
"""

from __future__ import annotations

from pathlib import Path

from gpucloud.gpu.domain import GpuDevice
from gpucloud.gpu.host import normalize_bus_id

CGROUP_ROOT = Path("/sys/fs/cgroup")


def dmem_regions(cgroup_root: Path = CGROUP_ROOT) -> dict[str, str]:
    """PCI bus id → the dmem region of that device's VRAM; empty without the controller."""
    try:
        controllers = (cgroup_root / "cgroup.controllers").read_text().split()
        capacity = (cgroup_root / "dmem.capacity").read_text()
    except OSError:
        return {}
    if "dmem" not in controllers:
        return {}
    regions: dict[str, str] = {}
    for line in capacity.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("/")
        if len(parts) == 3 and parts[0] == "drm" and parts[2].startswith("vram"):
            regions.setdefault(normalize_bus_id(parts[1]), name)
    return regions


def dmem_unified(regions: dict[str, str], gpu: GpuDevice,
                 memory_bytes: int | None, *, mig: bool = False) -> dict[str, str]:
    """The ``linux.resources.unified`` entries limiting a pod's memory on ``gpu``."""
    if not memory_bytes or mig or gpu.mig_mode or gpu.pci_bus_id is None:
        return {}
    region = regions.get(normalize_bus_id(gpu.pci_bus_id))
    return {"dmem.max": f"{region} {memory_bytes}"} if region else {}
