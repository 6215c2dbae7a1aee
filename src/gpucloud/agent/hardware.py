"""The node's hardware as the agent registers it, and the CDI devices of its GPUs.

Simulated GPUs get a CDI spec written into the agent's own state directory (so several
simulated agents on one machine never share or overwrite one); real GPUs use the specs of
the NVIDIA Container Toolkit in ``/etc/cdi`` and ``/var/run/cdi``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpucloud import __version__
from gpucloud.core.models import GpuInventory, NodeRegisterRequest
from gpucloud.gpu.cdi import DEFAULT_SPEC_DIRS, CdiRegistry, ContainerEdits, write_simulated_spec
from gpucloud.gpu.discovery import discover
from gpucloud.gpu.domain import GpuDevice, NodeHardware
from gpucloud.runtime.errors import RuntimeFailure


@dataclass(frozen=True)
class NodeDevices:
    hardware: NodeHardware
    cdi: CdiRegistry

    def gpus(self, uuids: Sequence[str]) -> tuple[GpuDevice, ...]:
        """The devices with these UUIDs, in the assignment's order."""
        found = []
        for uuid in uuids:
            gpu = self.hardware.gpu_by_uuid(uuid)
            if gpu is None:
                raise RuntimeFailure(f"GPU {uuid} is not on this node")
            found.append(gpu)
        return tuple(found)

    def edits(self, gpus: Sequence[GpuDevice]) -> list[ContainerEdits]:
        """CDI edits injecting ``gpus`` (none for a pod without GPUs)."""
        return self.cdi.edits_for_gpus(gpus) if gpus else []


def prepare_devices(simulate: str | None, node_name: str, state_dir: Path) -> NodeDevices:
    """Discover the hardware; for simulated GPUs, write their CDI spec under ``state_dir``."""
    hardware = discover(simulate, node_name)
    directories = list(DEFAULT_SPEC_DIRS)
    if hardware.provider == "simulated":
        own = state_dir / "cdi"
        write_simulated_spec(own, hardware)
        directories = [own]
    return NodeDevices(hardware, CdiRegistry.load(directories))


def registration(hardware: NodeHardware, *, join_token: str, name: str,
                 labels: dict[str, str], address: str | None) -> NodeRegisterRequest:
    """The registration body: the inventory, labels and address of this node."""
    return NodeRegisterRequest(
        join_token=join_token, name=name, cpu_cores=hardware.cpu_cores,
        memory_bytes=hardware.memory_bytes,
        gpus=[GpuInventory.model_validate(gpu.inventory()) for gpu in hardware.gpus],
        labels=labels, address=address, provider=hardware.provider, agent_version=__version__,
    )
