"""A stand-in for the ``pynvml`` module: the NVML *library* (the driver) is what is faked,
so that the provider's logic — NVLink peers, NUMA fallback, MIG, errors — runs for real on
hosts without NVIDIA hardware."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace


class NVMLError(Exception):
    pass


@dataclass
class FakeGpu:
    name: str
    uuid: str
    bus_id: str  # as NVML formats it: 00000000:18:00.0
    memory_bytes: int
    numa_node: int | None = None  # None: nvmlDeviceGetNumaNodeId is not supported
    mig: tuple[int, int] | None = None  # (current, pending); None: not supported
    links: list[str] = field(default_factory=list)  # remote bus id per active link
    nvlink_p2p: set[int] = field(default_factory=set)  # peers with NVLink P2P OK


class FakeNvml:
    NVMLError = NVMLError
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_P2P_CAPS_INDEX_NVLINK = 3
    NVML_P2P_STATUS_OK = 0
    NVML_P2P_STATUS_NOT_SUPPORTED = 5

    def __init__(self, gpus: list[FakeGpu], *, init_error: str | None = None,
                 driver: str = "550.54.15", cuda: int = 12040) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.driver = driver
        self.cuda = cuda
        self.initialized = False

    def _gpu(self, handle: int) -> FakeGpu:
        if not self.initialized:
            raise NVMLError("Uninitialized")
        return self.gpus[handle]

    def nvmlInit(self) -> None:
        if self.init_error:
            raise NVMLError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._gpu(index)
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self._gpu(handle).name

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetPciInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self._gpu(handle).bus_id.encode())

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(total=self._gpu(handle).memory_bytes)

    def nvmlDeviceGetNumaNodeId(self, handle: int) -> int:
        node = self._gpu(handle).numa_node
        if node is None:
            raise NVMLError("Function Not Found")
        return node

    def nvmlDeviceGetMigMode(self, handle: int) -> list[int]:
        mig = self._gpu(handle).mig
        if mig is None:
            raise NVMLError("Not Supported")
        return list(mig)

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:
        links = self._gpu(handle).links
        if link >= len(links):
            raise NVMLError("Not Supported")
        return self.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: int, link: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self._gpu(handle).links[link].encode())

    def nvmlDeviceGetP2PStatus(self, first: int, second: int, kind: int) -> int:
        assert kind == self.NVML_P2P_CAPS_INDEX_NVLINK
        ok = second in self._gpu(first).nvlink_p2p
        return self.NVML_P2P_STATUS_OK if ok else self.NVML_P2P_STATUS_NOT_SUPPORTED


GiB = 1024**3


def nvswitch_box(count: int = 8) -> FakeNvml:
    """A DGX-like box: every NVLink ends at an NVSwitch; P2P over NVLink to all GPUs."""
    switches = [f"00000000:{0xe0 + n:02X}:00.0" for n in range(4)]
    gpus = [
        FakeGpu(name="NVIDIA H100 80GB HBM3", uuid=f"GPU-{index:08d}-real",
                bus_id=f"00000000:{0x18 + index * 0x10:02X}:00.0", memory_bytes=80 * GiB,
                numa_node=index // 4, mig=(0, 0), links=switches * 4,
                nvlink_p2p=set(range(count)) - {index})
        for index in range(count)
    ]
    return FakeNvml(gpus)
