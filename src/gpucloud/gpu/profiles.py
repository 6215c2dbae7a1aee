"""Built-in hardware profiles for simulated GPU nodes.

Each profile mirrors a real machine closely enough for scheduling to behave as it would on
one: GPU model and memory, NUMA layout, NVLink domains and PCIe switches, host CPUs and
memory. ``cpu_cores`` counts logical CPUs, as ``os.cpu_count()`` does on a real host.
"""

from __future__ import annotations

import uuid as uuid_module
from dataclasses import dataclass

from gpucloud.core.errors import InvalidInput
from gpucloud.core.gpu_models import lookup
from gpucloud.gpu.domain import GpuDevice, NodeHardware

GiB = 1024**3
# A fixed namespace so that the same node name always yields the same GPU UUIDs.
_UUID_NAMESPACE = uuid_module.UUID("5b0e8c54-7e2a-4d3b-9c1f-6f1d2a9e0c11")


@dataclass(frozen=True)
class HardwareProfile:
    """A simulated machine.

    ``nvlink_domains`` lists groups of GPU indices connected all-to-all over NVLink;
    ``pcie_switches`` groups GPU indices behind one PCIe switch; ``numa_nodes[i]`` is the
    NUMA node of GPU ``i``.
    """

    name: str
    description: str
    gpu_model: str
    bus_ids: tuple[str, ...]
    numa_nodes: tuple[int, ...]
    cpu_cores: int
    memory_bytes: int
    nvlink_domains: tuple[tuple[int, ...], ...] = ()
    pcie_switches: tuple[tuple[int, ...], ...] = ()
    #: The GPUs start in MIG mode (an admin switched it on at drain time, as on a real
    #: node); their instances are made as MIG pods are placed.
    mig_mode: bool = False

    @property
    def gpu_count(self) -> int:
        return len(self.bus_ids)

    @property
    def numa_node_count(self) -> int:
        return len(set(self.numa_nodes))


PROFILES: tuple[HardwareProfile, ...] = (
    HardwareProfile(
        name="dgx-h100",
        description="NVIDIA DGX H100: 8x H100 80GB SXM, NVSwitch all-to-all, "
        "2x Xeon 8480C (112 cores), 2 TiB, 2 NUMA nodes",
        gpu_model="H100-80GB",
        bus_ids=("0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0",
                 "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"),
        numa_nodes=(0, 0, 0, 0, 1, 1, 1, 1),
        cpu_cores=224,
        memory_bytes=2048 * GiB,
        nvlink_domains=((0, 1, 2, 3, 4, 5, 6, 7),),
    ),
    HardwareProfile(
        name="h100-1",
        description="One H100 80GB SXM in MIG mode (7 compute / 8 memory slices), "
        "Xeon 8480C (56 cores), 256 GiB, 1 NUMA node",
        gpu_model="H100-80GB",
        bus_ids=("0000:18:00.0",),
        numa_nodes=(0,),
        cpu_cores=112,
        memory_bytes=256 * GiB,
        mig_mode=True,
    ),
    HardwareProfile(
        name="hgx-a100-40gb",
        description="HGX A100 40GB: 8x A100 40GB SXM4, NVSwitch all-to-all, "
        "2x EPYC 7742 (128 cores), 1 TiB, 2 NUMA nodes",
        gpu_model="A100-40GB",
        bus_ids=("0000:07:00.0", "0000:0f:00.0", "0000:47:00.0", "0000:4e:00.0",
                 "0000:87:00.0", "0000:90:00.0", "0000:b7:00.0", "0000:bd:00.0"),
        numa_nodes=(0, 0, 0, 0, 1, 1, 1, 1),
        cpu_cores=256,
        memory_bytes=1024 * GiB,
        nvlink_domains=((0, 1, 2, 3, 4, 5, 6, 7),),
    ),
    HardwareProfile(
        name="pcie-l40s-4",
        description="PCIe server: 4x L40S 48GB (no NVLink), PCIe switch pairs 0-1 and 2-3, "
        "2x EPYC 9354 (64 cores), 768 GiB, 2 NUMA nodes",
        gpu_model="L40S",
        bus_ids=("0000:41:00.0", "0000:42:00.0", "0000:c1:00.0", "0000:c2:00.0"),
        numa_nodes=(0, 0, 1, 1),
        cpu_cores=128,
        memory_bytes=768 * GiB,
        pcie_switches=((0, 1), (2, 3)),
    ),
    HardwareProfile(
        name="rtx4090-2",
        description="Workstation: 2x GeForce RTX 4090 24GB (no NVLink), "
        "Threadripper 7960X (24 cores), 256 GiB, 1 NUMA node",
        gpu_model="RTX4090",
        bus_ids=("0000:01:00.0", "0000:41:00.0"),
        numa_nodes=(0, 0),
        cpu_cores=48,
        memory_bytes=256 * GiB,
    ),
)

_BY_NAME = {profile.name: profile for profile in PROFILES}


def list_profiles() -> tuple[HardwareProfile, ...]:
    return PROFILES


def get_profile(name: str) -> HardwareProfile:
    """The profile called ``name``; InvalidInput naming the known ones otherwise."""
    profile = _BY_NAME.get(name.strip().lower())
    if profile is None:
        known = ", ".join(sorted(_BY_NAME))
        raise InvalidInput("simulate", f"unknown hardware profile {name!r} (known: {known})")
    return profile


def simulated_uuid(node_name: str, index: int) -> str:
    """A stable NVML-style UUID (``GPU-xxxxxxxx-xxxx-...``) for GPU ``index`` of a node."""
    return f"GPU-{uuid_module.uuid5(_UUID_NAMESPACE, f'{node_name}/{index}')}"


def _group_of(groups: tuple[tuple[int, ...], ...], index: int) -> tuple[int, ...] | None:
    return next((group for group in groups if index in group), None)


def _device(profile: HardwareProfile, node_name: str, index: int) -> GpuDevice:
    model = lookup(profile.gpu_model)
    if model is None:  # the profiles above only use catalog models
        raise ValueError(f"profile {profile.name} uses unknown model {profile.gpu_model}")
    domain = _group_of(profile.nvlink_domains, index) or ()
    switch = _group_of(profile.pcie_switches, index)
    return GpuDevice(
        index=index,
        uuid=simulated_uuid(node_name, index),
        model=model.name,
        memory_mib=model.memory_mib,
        numa_node=profile.numa_nodes[index],
        nvlink_peers=tuple(peer for peer in domain if peer != index),
        pci_bus_id=profile.bus_ids[index],
        pcie_switch=profile.pcie_switches.index(switch) if switch else None,
        mig_capable=model.mig_capable,
        mig_mode=profile.mig_mode and model.mig_capable,
        simulated=True,
    )


def simulate(profile_name: str, node_name: str) -> NodeHardware:
    """The hardware of a simulated node: the profile's GPUs, CPUs and memory."""
    profile = get_profile(profile_name)
    gpus = tuple(_device(profile, node_name, index) for index in range(profile.gpu_count))
    return NodeHardware(
        cpu_cores=profile.cpu_cores,
        memory_bytes=profile.memory_bytes,
        gpus=gpus,
        provider="simulated",
        profile=profile.name,
        note=f"simulated hardware profile {profile.name}",
    )
