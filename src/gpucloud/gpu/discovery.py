"""What hardware an agent advertises: real GPUs, a simulated profile, or CPUs only."""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType
from typing import Any

from gpucloud.gpu import host
from gpucloud.gpu.domain import NodeHardware
from gpucloud.gpu.nvml import DEFAULT_NVML, NvmlInventory, read_nvml
from gpucloud.gpu.profiles import simulate as simulate_profile

log = logging.getLogger(__name__)


def discover(
    simulate: str | None,
    node_name: str,
    *,
    nvml: ModuleType | Any | None = DEFAULT_NVML,
    meminfo: Path = Path("/proc/meminfo"),
    sysfs: Path = Path("/sys"),
) -> NodeHardware:
    """The node's hardware.

    An explicit ``simulate`` profile wins even when NVML finds GPUs, so a developer box with
    one real GPU can still pose as a DGX in a test cluster (the note says so). Without a
    profile: NVML's GPUs when a driver is present, else a CPU-only node with a note saying
    why. Simulated nodes report the profile's CPUs and memory so the scheduler sees the
    profile's capacity; the others report the host's.
    """
    reading = read_nvml(nvml, sysfs)
    if simulate:
        hardware = simulate_profile(simulate, node_name)
        if isinstance(reading, NvmlInventory):
            note = f"{hardware.note}; {len(reading.gpus)} real GPU(s) found by NVML are ignored"
            hardware = hardware.model_copy(update={"note": note})
        return hardware
    cores, memory = host.cpu_cores(), host.memory_bytes(meminfo)
    if isinstance(reading, NvmlInventory):
        return NodeHardware(
            cpu_cores=cores,
            memory_bytes=memory,
            gpus=reading.gpus,
            provider="nvml",
            driver_version=reading.driver_version,
            cuda_version=reading.cuda_version,
        )
    note = f"no GPUs: {reading.reason}; registering a CPU-only node (use --simulate PROFILE)"
    log.info(note)
    return NodeHardware(cpu_cores=cores, memory_bytes=memory, provider="none", note=note)
