"""GPU inventory through NVML (``nvidia-ml-py``).

``read_nvml`` returns an ``NvmlUnavailable`` with a one-line reason instead of raising when
there is no library, no driver or no GPU, so a host without NVIDIA hardware is an expected
outcome, not a trace. The NVML module is a parameter so tests can stand in for the driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from gpucloud.core.gpu_models import lookup
from gpucloud.gpu.domain import GpuDevice
from gpucloud.gpu.host import normalize_bus_id, pci_numa_node
from gpucloud.gpu.pci import pci_facts, switch_numbers

try:
    import pynvml as _pynvml

    DEFAULT_NVML: ModuleType | None = _pynvml
except ImportError:  # nvidia-ml-py is a dependency, but a broken install must not crash
    DEFAULT_NVML = None


@dataclass(frozen=True)
class NvmlInventory:
    gpus: tuple[GpuDevice, ...]
    driver_version: str | None
    cuda_version: str | None


@dataclass(frozen=True)
class NvmlUnavailable:
    reason: str


def _text(value: str | bytes) -> str:
    return (value.decode(errors="replace") if isinstance(value, bytes) else value).strip("\x00")


def _optional(nvml: Any, call: Any, *args: Any) -> Any:
    """The result of an NVML query, or None when this GPU or driver does not support it."""
    try:
        return call(*args)
    except nvml.NVMLError:
        return None


def _cuda_version(nvml: Any) -> str | None:
    version = _optional(nvml, nvml.nvmlSystemGetCudaDriverVersion_v2)
    if not isinstance(version, int) or version <= 0:
        return None
    return f"{version // 1000}.{(version % 1000) // 10}"


def _numa_node(nvml: Any, handle: Any, bus_id: str, sysfs: Path) -> int | None:
    node = _optional(nvml, nvml.nvmlDeviceGetNumaNodeId, handle)
    if isinstance(node, int) and node >= 0:
        return node
    return pci_numa_node(bus_id, sysfs)


def _mig(nvml: Any, handle: Any) -> tuple[bool, bool]:
    """(capable, enabled) from the current MIG mode."""
    modes = _optional(nvml, nvml.nvmlDeviceGetMigMode, handle)
    if modes is None:
        return False, False
    return True, modes[0] == nvml.NVML_DEVICE_MIG_ENABLE


def _link_remotes(nvml: Any, handle: Any) -> list[str]:
    """Bus ids at the far end of each active NVLink (peer GPUs or NVSwitches)."""
    remotes = []
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        state = _optional(nvml, nvml.nvmlDeviceGetNvLinkState, handle, link)
        if state != nvml.NVML_FEATURE_ENABLED:
            continue
        info = _optional(nvml, nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
        if info is not None:
            remotes.append(normalize_bus_id(info.busId))
    return remotes


def _nvlink_peers(nvml: Any, handles: list[Any], bus_ids: list[str], index: int) -> tuple[int, ...]:
    """Indices of GPUs reachable over NVLink from GPU ``index``.

    Direct links name the peer's bus id. On NVSwitch systems every link ends at a switch, so
    the peers are those for which NVML reports NVLink P2P as OK.
    """
    remotes = _link_remotes(nvml, handles[index])
    peers = {bus_ids.index(bus) for bus in remotes if bus in bus_ids}
    if any(bus not in bus_ids for bus in remotes):
        for other, handle in enumerate(handles):
            if other == index:
                continue
            status = _optional(
                nvml, nvml.nvmlDeviceGetP2PStatus, handles[index], handle,
                nvml.NVML_P2P_CAPS_INDEX_NVLINK,
            )
            if status == nvml.NVML_P2P_STATUS_OK:
                peers.add(other)
    peers.discard(index)
    return tuple(sorted(peers))


def _device(
    nvml: Any, handles: list[Any], bus_ids: list[str], index: int, sysfs: Path
) -> GpuDevice:
    handle = handles[index]
    name = _text(nvml.nvmlDeviceGetName(handle))
    known = lookup(name)
    capable, enabled = _mig(nvml, handle)
    return GpuDevice(
        index=index,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        model=known.name if known else name,
        memory_mib=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // (1024 * 1024),
        numa_node=_numa_node(nvml, handle, bus_ids[index], sysfs),
        nvlink_peers=_nvlink_peers(nvml, handles, bus_ids, index),
        pci_bus_id=bus_ids[index],
        mig_capable=capable,
        mig_mode=enabled,
    )


def _with_pci(gpus: tuple[GpuDevice, ...], sysfs: Path) -> tuple[GpuDevice, ...]:
    """The PCIe switch and IOMMU group of each GPU, from sysfs (gpu/pci)."""
    facts = [pci_facts(gpu.pci_bus_id, sysfs) if gpu.pci_bus_id else None for gpu in gpus]
    switches = switch_numbers([fact.switch if fact else None for fact in facts])
    return tuple(gpu.model_copy(update={"pcie_switch": switch,
                                        "iommu_group": fact.iommu_group if fact else None})
                 for gpu, fact, switch in zip(gpus, facts, switches, strict=True))


def _inventory(nvml: Any, sysfs: Path) -> NvmlInventory:
    count = int(nvml.nvmlDeviceGetCount())
    handles = [nvml.nvmlDeviceGetHandleByIndex(index) for index in range(count)]
    bus_ids = [normalize_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId) for handle in handles]
    gpus = _with_pci(tuple(_device(nvml, handles, bus_ids, index, sysfs)
                           for index in range(count)), sysfs)
    driver = _optional(nvml, nvml.nvmlSystemGetDriverVersion)
    return NvmlInventory(gpus, _text(driver) if driver else None, _cuda_version(nvml))


def read_nvml(
    nvml: ModuleType | Any | None = DEFAULT_NVML, sysfs: Path = Path("/sys")
) -> NvmlInventory | NvmlUnavailable:
    """The GPUs NVML reports, or why NVML cannot be used on this host."""
    if nvml is None:
        return NvmlUnavailable("nvidia-ml-py (pynvml) is not installed")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        return NvmlUnavailable(f"NVML unavailable: {error}")
    try:
        inventory = _inventory(nvml, sysfs)
    except nvml.NVMLError as error:
        return NvmlUnavailable(f"NVML query failed: {error}")
    finally:
        _optional(nvml, nvml.nvmlShutdown)
    if not inventory.gpus:
        return NvmlUnavailable(f"NVIDIA driver {inventory.driver_version} reports no GPUs")
    return inventory
