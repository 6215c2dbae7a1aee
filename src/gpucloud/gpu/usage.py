"""Per-pod GPU utilisation and memory: from NVML, or from the simulated model.

``NvmlGpuUsage``: a GPU the pod has alone reads the device's utilisation
(``nvmlDeviceGetUtilizationRates``: the share of the last sample period in which any
kernel ran) and its used memory. A shared GPU (milli-GPU, time-sliced) is attributed per
process: ``nvmlDeviceGetProcessUtilization`` since the last timestamp seen on that GPU,
summed over the pod's host pids (mean per pid when it has several samples), and the pod's
processes' memory from ``nvmlDeviceGetComputeRunningProcesses``. MIG instances have no
utilisation in NVML (None, billed by allocation); under MPS every client's work is
credited to the MPS server, so the pod's own figures are not measurable there either.

``SimulatedGpuUsage``: a deterministic model of the pod's declared load,
``GPUCLOUD_SIM_GPU_UTIL`` (percent, 0-100) in the pod's environment: each assigned GPU
reads that utilisation and that share of its memory as used; no variable reads 0.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol

from gpucloud.core.usage import UsageGpu
from gpucloud.gpu.domain import GpuDevice
from gpucloud.gpu.nvml import DEFAULT_NVML

log = logging.getLogger(__name__)
SIM_UTIL_VAR = "GPUCLOUD_SIM_GPU_UTIL"
MIB = 1024 * 1024


class GpuUsage(Protocol):
    def sample(self, gpus: Sequence[GpuDevice], env: Mapping[str, str],
               pids: Collection[int], exclusive: bool) -> list[UsageGpu]: ...


def declared_util(env: Mapping[str, str]) -> float:
    """``GPUCLOUD_SIM_GPU_UTIL`` as a percent in [0, 100]; 0 when absent or not a number."""
    text = env.get(SIM_UTIL_VAR)
    if text is None:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        return 0.0
    return min(100.0, max(0.0, value)) if value == value else 0.0  # NaN reads 0


class SimulatedGpuUsage:
    """The model is device-wide per pod: processes and sharing do not enter into it."""

    def sample(self, gpus: Sequence[GpuDevice], env: Mapping[str, str],
               _pids: Collection[int], _exclusive: bool) -> list[UsageGpu]:
        util = declared_util(env)
        return [UsageGpu(uuid=gpu.uuid, util_percent=util,
                         memory_used_bytes=round(gpu.memory_mib * MIB * util / 100))
                for gpu in gpus]


class NvmlGpuUsage:
    """NVML, initialised once; the module is a parameter so tests can stand in for it."""

    def __init__(self, nvml: ModuleType | Any | None = DEFAULT_NVML) -> None:
        self.nvml: Any = nvml
        self._ready = False
        self._lock = threading.Lock()
        #: Per GPU, the newest process-utilisation timestamp already read (µs).
        self._last_seen: dict[str, int] = {}

    def sample(self, gpus: Sequence[GpuDevice], _env: Mapping[str, str],
               pids: Collection[int], exclusive: bool) -> list[UsageGpu]:
        if self.nvml is None or not self._init():
            return [UsageGpu(uuid=gpu.uuid) for gpu in gpus]
        with self._lock:
            return [self._one(gpu, set(pids), exclusive) for gpu in gpus]

    def _init(self) -> bool:
        if not self._ready:
            try:
                self.nvml.nvmlInit()
                self._ready = True
            except self.nvml.NVMLError as error:
                log.warning("NVML unavailable for usage sampling: %s", error)
        return self._ready

    def _one(self, gpu: GpuDevice, pids: set[int], exclusive: bool) -> UsageGpu:
        nvml = self.nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
        except nvml.NVMLError:
            return UsageGpu(uuid=gpu.uuid)
        if exclusive:
            util = self._call(nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = self._call(nvml.nvmlDeviceGetMemoryInfo, handle)
            return UsageGpu(uuid=gpu.uuid,
                            util_percent=float(util.gpu) if util is not None else None,
                            memory_used_bytes=int(memory.used) if memory is not None else None)
        return UsageGpu(uuid=gpu.uuid, util_percent=self._process_util(gpu.uuid, handle, pids),
                        memory_used_bytes=self._process_memory(handle, pids))

    def _call(self, function: Any, *args: Any) -> Any:
        try:
            return function(*args)
        except self.nvml.NVMLError:
            return None

    def _process_util(self, uuid: str, handle: Any, pids: set[int]) -> float | None:
        """The pod's processes' SM utilisation since the last read of this GPU."""
        nvml = self.nvml
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(handle, self._last_seen.get(uuid, 0))
        except nvml.NVMLError_NotFound:
            return 0.0  # nothing ran since the last read
        except nvml.NVMLError:
            return None  # not supported (MIG, some products)
        per_pid: dict[int, list[float]] = {}
        for sample in samples:
            self._last_seen[uuid] = max(self._last_seen.get(uuid, 0), int(sample.timeStamp))
            if int(sample.pid) in pids:
                per_pid.setdefault(int(sample.pid), []).append(float(sample.smUtil))
        total = sum(sum(values) / len(values) for values in per_pid.values())
        return min(100.0, total)

    def _process_memory(self, handle: Any, pids: set[int]) -> int | None:
        processes = self._call(self.nvml.nvmlDeviceGetComputeRunningProcesses, handle)
        if processes is None:
            return None
        return sum(int(p.usedGpuMemory or 0) for p in processes if int(p.pid) in pids)


def gpu_usage(provider: str) -> GpuUsage:
    """The sampler for a node's GPU provider (``simulated``, ``nvml`` or ``none``)."""
    return SimulatedGpuUsage() if provider == "simulated" else NvmlGpuUsage()
