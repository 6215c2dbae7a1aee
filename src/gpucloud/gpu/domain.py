"""What the agent knows about its hardware, as pydantic models that serialize to JSON."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpucloud.core.gpu_models import canonical_name

ProviderName = Literal["nvml", "simulated", "none"]


class GpuDevice(BaseModel):
    """One physical GPU (or simulated one) as seen by the host.

    ``index`` is the host's device index (NVML order); ``nvlink_peers`` lists the indices of
    GPUs reachable over NVLink (directly or through NVSwitch). ``pcie_switch`` groups GPUs
    behind the same PCIe switch when known; None when unknown or not shared.
    """

    model_config = ConfigDict(frozen=True)

    index: int = Field(ge=0)
    uuid: str = Field(min_length=1)
    model: str = Field(min_length=1)
    memory_mib: int = Field(ge=0)
    numa_node: int | None = None
    nvlink_peers: tuple[int, ...] = ()
    pci_bus_id: str | None = None
    pcie_switch: int | None = None
    #: The IOMMU group (sysfs): what VFIO passthrough would bind as one unit.
    iommu_group: int | None = None
    mig_capable: bool = False
    mig_mode: bool = False
    simulated: bool = False

    @field_validator("model")
    @classmethod
    def _canonical_model(cls, value: str) -> str:
        return canonical_name(value)

    def inventory(self) -> dict[str, Any]:
        """The fields of the API's ``GpuInventory`` (node registration body)."""
        return {
            "uuid": self.uuid,
            "model": self.model,
            "memory_mib": self.memory_mib,
            "numa_node": self.numa_node if self.numa_node is not None else 0,
            "nvlink_peers": list(self.nvlink_peers),
            "index": self.index,
            "pci_bus_id": self.pci_bus_id,
            "pcie_switch": self.pcie_switch,
            "iommu_group": self.iommu_group,
            "mig_mode": self.mig_mode,
            "mig_capable": self.mig_capable,
        }


class NodeHardware(BaseModel):
    """The inventory an agent registers: CPUs, memory, GPUs and where they came from."""

    model_config = ConfigDict(frozen=True)

    cpu_cores: int = Field(gt=0)
    memory_bytes: int = Field(gt=0)
    gpus: tuple[GpuDevice, ...] = ()
    provider: ProviderName
    driver_version: str | None = None
    cuda_version: str | None = None
    profile: str | None = None
    note: str | None = None

    def gpu_by_uuid(self, uuid: str) -> GpuDevice | None:
        return next((gpu for gpu in self.gpus if gpu.uuid == uuid), None)
