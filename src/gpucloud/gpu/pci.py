"""PCI topology of a GPU from sysfs: NUMA node, PCIe switch, IOMMU group.

``/sys/bus/pci/devices/<bus id>`` links to the device's place in the hierarchy, e.g.
``/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0``: the root
port, then a switch's upstream port (``16:00.0``), its downstream port (``17:00.0``), then
the GPU. Two GPUs behind one switch share the upstream port, which is how the switch is
named here. A GPU directly on a root port has no switch (None). The IOMMU group is the
name of the ``iommu_group`` link's target: what VFIO passthrough binds as one unit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gpucloud.gpu.host import normalize_bus_id, pci_numa_node

_BUS_ID = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


@dataclass(frozen=True)
class PciFacts:
    bus_id: str
    numa_node: int | None = None
    #: The bus id of the upstream port of the PCIe switch the GPU sits behind.
    switch: str | None = None
    iommu_group: int | None = None


def _device_dir(bus_id: str, sysfs: Path) -> Path:
    return sysfs / "bus" / "pci" / "devices" / normalize_bus_id(bus_id)


def _chain(bus_id: str, sysfs: Path) -> list[str]:
    """PCI addresses from the root port down to the device (from the resolved link)."""
    try:
        path = _device_dir(bus_id, sysfs).resolve(strict=True)
    except OSError:
        return []
    return [part for part in path.parts if _BUS_ID.match(part)]


def pcie_switch(bus_id: str, sysfs: Path = Path("/sys")) -> str | None:
    """The switch's upstream port: the device's grandparent, when that is not a root port
    (a root port's parent is the ``pci<domain>:<bus>`` host bridge, not a PCI address)."""
    chain = _chain(bus_id, sysfs)
    return chain[-3] if len(chain) >= 4 else None


def iommu_group(bus_id: str, sysfs: Path = Path("/sys")) -> int | None:
    try:
        target = (_device_dir(bus_id, sysfs) / "iommu_group").resolve(strict=True)
        return int(target.name)
    except (OSError, ValueError):
        return None


def pci_facts(bus_id: str, sysfs: Path = Path("/sys")) -> PciFacts:
    normalized = normalize_bus_id(bus_id)
    return PciFacts(normalized, pci_numa_node(normalized, sysfs),
                    pcie_switch(normalized, sysfs), iommu_group(normalized, sysfs))


def switch_numbers(switches: list[str | None]) -> list[int | None]:
    """Small numbers for the switches GPUs share (None: alone or unknown), in order of
    first appearance, as ``GpuDevice.pcie_switch`` holds them."""
    shared = [s for s in switches if s is not None and switches.count(s) > 1]
    order = list(dict.fromkeys(shared))
    return [order.index(s) if s in order else None for s in switches]
