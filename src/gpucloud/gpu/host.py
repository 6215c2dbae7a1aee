"""CPU, memory and PCI facts about the host, read from procfs and sysfs."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_cores() -> int:
    """Logical CPUs this process may run on (the affinity mask, else all online CPUs)."""
    try:
        return len(os.sched_getaffinity(0))
    except OSError:
        return os.cpu_count() or 1


def memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Total memory from ``MemTotal`` in /proc/meminfo."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            value, _, unit = line.split(":", 1)[1].strip().partition(" ")
            return int(value) * (1024 if unit.strip().lower() == "kb" else 1)
    raise ValueError(f"{meminfo} has no MemTotal line")


def normalize_bus_id(bus_id: str | bytes) -> str:
    """A PCI address in sysfs form: NVML's ``00000000:18:00.0`` becomes ``0000:18:00.0``."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    text = text.strip().strip("\x00").lower()
    domain, sep, rest = text.partition(":")
    if not sep:
        return text
    if rest.count(":") == 0:  # no domain given: "18:00.0"
        return f"0000:{text}"
    return f"{int(domain, 16):04x}:{rest}"


def pci_numa_node(bus_id: str, sysfs: Path = Path("/sys")) -> int | None:
    """The NUMA node of a PCI device; None when sysfs has no answer or reports -1."""
    path = sysfs / "bus" / "pci" / "devices" / normalize_bus_id(bus_id) / "numa_node"
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None
