"""A stand-in for NVML's MIG API (the driver is what is faked): GPU instances at
placements, compute instances in them, MIG device handles with UUIDs; every call is
recorded so a test can assert the sequence the agent makes."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from tests.unit.gpu.fake_nvml import FakeGpu, FakeNvml, NVMLError

# NVML's constants (nvml.h): GPU instance profiles, compute instance profiles.
GI_PROFILES = {0: (1, 1), 1: (2, 2), 2: (3, 4), 3: (4, 4), 4: (7, 8), 9: (1, 2)}  # id: (c, size)
GI_STARTS = {0: (0, 1, 2, 3, 4, 5, 6), 1: (0, 2, 4), 2: (0, 4), 3: (0,), 4: (0,), 9: (0, 2, 4, 6)}


@dataclass
class FakeGi:
    gpu: int
    id: int
    profile: int
    start: int
    size: int
    cis: dict[int, int] = field(default_factory=dict)  # ci id -> ci profile


class FakeMigNvml(FakeNvml):
    NVML_GPU_INSTANCE_PROFILE_1_SLICE = 0
    NVML_GPU_INSTANCE_PROFILE_2_SLICE = 1
    NVML_GPU_INSTANCE_PROFILE_3_SLICE = 2
    NVML_GPU_INSTANCE_PROFILE_4_SLICE = 3
    NVML_GPU_INSTANCE_PROFILE_7_SLICE = 4
    NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 = 9
    NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE = 0
    NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE = 1
    NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE = 2
    NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE = 3
    NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE = 4
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0

    def __init__(self, gpus: list[FakeGpu]) -> None:
        super().__init__(gpus)
        self.gis: list[FakeGi] = []
        self.calls: list[tuple[Any, ...]] = []

    def _used(self, gpu: int) -> int:
        return sum(((1 << g.size) - 1) << g.start for g in self.gis if g.gpu == gpu)

    def nvmlDeviceGetMinorNumber(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: int, profile: int) -> SimpleNamespace:
        self.calls.append(("GetGpuInstanceProfileInfo", handle, profile))
        return SimpleNamespace(id=profile)

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, handle: int,
                                                   profile: int) -> list[SimpleNamespace]:
        self.calls.append(("GetGpuInstancePossiblePlacements", handle, profile))
        size, used = GI_PROFILES[profile][1], self._used(handle)
        return [SimpleNamespace(start=s, size=size) for s in GI_STARTS[profile]
                if used & (((1 << size) - 1) << s) == 0]

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: int, profile: int,
                                                 placement: Any) -> FakeGi:
        self.calls.append(("CreateGpuInstanceWithPlacement", handle, profile, placement.start))
        size = GI_PROFILES[profile][1]
        if self._used(handle) & (((1 << size) - 1) << placement.start):
            raise NVMLError("Insufficient Resources")
        gi = FakeGi(handle, 1 + max((g.id for g in self.gis), default=0), profile,
                    placement.start, size)
        self.gis.append(gi)
        return gi

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi: FakeGi, profile: int,
                                                     engine: int) -> SimpleNamespace:
        self.calls.append(("GetComputeInstanceProfileInfo", gi.id, profile))
        return SimpleNamespace(id=profile)

    def nvmlGpuInstanceCreateComputeInstance(self, gi: FakeGi, profile: int) -> tuple[FakeGi, int]:
        self.calls.append(("CreateComputeInstance", gi.id, profile))
        gi.cis[0] = profile
        return gi, 0

    def nvmlGpuInstanceGetInfo(self, gi: FakeGi) -> SimpleNamespace:
        return SimpleNamespace(id=gi.id, profileId=gi.profile,
                               placement=SimpleNamespace(start=gi.start, size=gi.size))

    def nvmlComputeInstanceGetInfo(self, ci: tuple[FakeGi, int]) -> SimpleNamespace:
        return SimpleNamespace(id=ci[1])

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: int) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: int, index: int) -> tuple[FakeGi, int]:
        devices = [(g, ci) for g in self.gis if g.gpu == handle for ci in g.cis]
        if index >= len(devices):
            raise NVMLError("Not Found")
        return devices[index]

    def nvmlDeviceGetGpuInstanceId(self, device: tuple[FakeGi, int]) -> int:
        return device[0].id

    def nvmlDeviceGetComputeInstanceId(self, device: tuple[FakeGi, int]) -> int:
        return device[1]

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        if isinstance(handle, tuple):
            return f"MIG-fake-{handle[0].gpu}-{handle[0].id}-{handle[1]}"
        return super().nvmlDeviceGetUUID(handle)

    def nvmlDeviceGetGpuInstances(self, handle: int, profile: int) -> list[FakeGi]:
        return [g for g in self.gis if g.gpu == handle and g.profile == profile]

    def nvmlGpuInstanceGetComputeInstances(self, gi: FakeGi,
                                           profile: int) -> list[tuple[FakeGi, int]]:
        return [(gi, ci) for ci, p in gi.cis.items() if p == profile]

    def nvmlDeviceGetGpuInstanceById(self, handle: int, gi_id: int) -> FakeGi:
        return next(g for g in self.gis if g.gpu == handle and g.id == gi_id)

    def nvmlGpuInstanceGetComputeInstanceById(self, gi: FakeGi, ci_id: int) -> tuple[FakeGi, int]:
        return gi, ci_id

    def nvmlComputeInstanceDestroy(self, ci: tuple[FakeGi, int]) -> None:
        self.calls.append(("ComputeInstanceDestroy", ci[0].id, ci[1]))
        del ci[0].cis[ci[1]]

    def nvmlGpuInstanceDestroy(self, gi: FakeGi) -> None:
        self.calls.append(("GpuInstanceDestroy", gi.id))
        if gi.cis:
            raise NVMLError("In use by another client")
        self.gis.remove(gi)
