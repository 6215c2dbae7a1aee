"""Load-aware placement: a score and an optional filter on what nodes really use.

After Koordinator's LoadAwareScheduling and Crane's Dynamic scheduler. A node's load is

    observed use (EWMA of its samples; the max of recent samples for the filter)
    − the observed use of its pods that ended since the sample (floored at 0)
    + for each pod not yet reported (or placed within one report interval of the sample):
      max(0, estimate − what it is already seen to use)
    + the estimate of every pod placed since the snapshot (the scheduler's own in-flight
      reservations: the growth of the node's requests since the load was taken)

where a pod's estimate is 85 % of max(request, limit) for CPU and 70 % for memory
(Koordinator's ``estimatedScalingFactors``), and the incoming pod counts as its estimate.
``estimate_load`` computes the first three terms (the control plane and the simulator call
it); the plugins add the last two.

Metrics expire after ``expiry_seconds`` (180 s, three report intervals). The choice for an
expired or missing node is **fail-open**: the filter admits it and the score treats each of
its pods as using its estimate (as Koordinator does for a node that reports no usage), so a
node whose agent stopped reporting is neither blocked forever (the most reported problem
with stale high metrics) nor preferred for looking empty. ``fail_closed: true`` rejects
such nodes instead.

The score is 0..100 (free fraction of each resource after the pod, weighted); with
``_normalize`` in the runner its weight in a profile must stay below the fragmentation
score's, so that it decides among placements FGD finds (nearly) equal and does not undo
packing (see docs/scheduler.md, "Load-aware placement").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gpucloud.scheduler.framework.cluster import BoolArray, ClusterState, FloatArray, IntArray
from gpucloud.scheduler.framework.plugin import Cycle, Rejections
from gpucloud.scheduler.framework.registry import PluginArgs
from gpucloud.scheduler.types import FULL_GPU_MILLI, NodeLoad

CPU_FACTOR = 0.85
MEMORY_FACTOR = 0.70
#: A GPU share is estimated at its whole share of the GPU's time.
GPU_FACTOR = 1.0
EXPIRY_SECONDS = 180.0
CPU_THRESHOLD = 65.0
MEMORY_THRESHOLD = 95.0
MAX_SCORE = 100.0
_CACHE_KEY = "loadaware"


@dataclass(frozen=True)
class Factors:
    """Estimated share of max(request, limit) a pod uses before it reports (0..1)."""

    cpu: float = CPU_FACTOR
    memory: float = MEMORY_FACTOR

    @classmethod
    def from_args(cls, args: PluginArgs) -> Factors:
        return cls(_percent(args, "cpu_factor", CPU_FACTOR * 100) / 100,
                   _percent(args, "memory_factor", MEMORY_FACTOR * 100) / 100)


def _percent(args: PluginArgs, key: str, default: float) -> float:
    value = float(args.get(key, default))
    if not 0.0 <= value <= 1000.0:
        raise ValueError(f"LoadAware: {key} must be a percentage, got {value}")
    return value


@dataclass(frozen=True)
class NodeSample:
    """A node's own figures, as the usage service smooths them (``age_seconds`` old).

    ``gpu_util``: GPU index -> utilisation percent of the shared GPUs."""

    age_seconds: float
    cpu_milli: float
    memory_bytes: float
    cpu_peak_milli: float | None = None
    memory_peak_bytes: float | None = None
    gpu_util: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PodUse:
    """A pod on a node as the estimate sees it.

    ``observed_*`` are its own latest reported use (None until it has reported);
    ``ended``: it ended after the node's sample, so its use is still in the sample;
    ``recent``: placed within one report interval before the sample, so the sample may
    not show its full use yet (Koordinator counts it as its estimate, minus what it uses).
    """

    cpu_request_milli: int
    memory_request_bytes: int
    cpu_limit_milli: int = 0
    memory_limit_bytes: int = 0
    observed_cpu_milli: float | None = None
    observed_memory_bytes: float | None = None
    gpu_milli: dict[int, int] = field(default_factory=dict)
    ended: bool = False
    recent: bool = False

    def estimate(self, factors: Factors) -> tuple[float, float]:
        """(CPU milli, memory bytes) it is expected to use, capped at its limit."""
        cpu = max(self.cpu_request_milli, self.cpu_limit_milli) * factors.cpu
        memory = max(self.memory_request_bytes, self.memory_limit_bytes) * factors.memory
        if self.cpu_limit_milli:
            cpu = min(cpu, self.cpu_limit_milli)
        if self.memory_limit_bytes:
            memory = min(memory, self.memory_limit_bytes)
        return cpu, memory

    def unseen(self, factors: Factors) -> tuple[float, float]:
        """What the sample may not show of it yet: estimate − observed, floored at 0."""
        if self.observed_cpu_milli is not None and not self.recent:
            return 0.0, 0.0
        cpu, memory = self.estimate(factors)
        return (max(0.0, cpu - (self.observed_cpu_milli or 0.0)),
                max(0.0, memory - (self.observed_memory_bytes or 0.0)))


def estimate_load(sample: NodeSample, pods: Sequence[PodUse],
                  factors: Factors | None = None) -> NodeLoad:
    """The node's load from its sample and its pods (active and ended since the sample)."""
    factors = factors or Factors()
    active = [p for p in pods if not p.ended]
    gone_cpu = sum(p.observed_cpu_milli or 0.0 for p in pods if p.ended)
    gone_memory = sum(p.observed_memory_bytes or 0.0 for p in pods if p.ended)
    unseen = [p.unseen(factors) for p in active]
    extra_cpu = sum(c for c, _ in unseen)
    extra_memory = sum(m for _, m in unseen)
    peak_cpu = sample.cpu_milli if sample.cpu_peak_milli is None else sample.cpu_peak_milli
    peak_memory = (sample.memory_bytes if sample.memory_peak_bytes is None
                   else sample.memory_peak_bytes)
    gpu_requested: dict[int, int] = {}
    for pod in active:
        for index, milli in pod.gpu_milli.items():
            gpu_requested[index] = gpu_requested.get(index, 0) + milli
    return NodeLoad(
        age_seconds=sample.age_seconds,
        cpu_milli=max(0.0, sample.cpu_milli - gone_cpu) + extra_cpu,
        memory_bytes=max(0.0, sample.memory_bytes - gone_memory) + extra_memory,
        cpu_peak_milli=max(0.0, peak_cpu - gone_cpu) + extra_cpu,
        memory_peak_bytes=max(0.0, peak_memory - gone_memory) + extra_memory,
        requested_cpu_milli=sum(p.cpu_request_milli for p in active),
        requested_memory_bytes=sum(p.memory_request_bytes for p in active),
        gpu_util=dict(sample.gpu_util),
        gpu_requested_milli=gpu_requested,
    )


@dataclass
class LoadArrays:
    """The snapshot's loads as arrays ([N] and [N, G]); ``fresh`` marks usable metrics."""

    fresh: BoolArray
    cpu: FloatArray
    memory: FloatArray
    cpu_peak: FloatArray
    memory_peak: FloatArray
    base_cpu: IntArray
    base_memory: IntArray
    gpu_util: FloatArray
    base_gpu: IntArray
    has_gpu_util: BoolArray

    @classmethod
    def build(cls, state: ClusterState, expiry: float) -> LoadArrays:
        n, g = state.num_nodes, state.max_gpus
        out = cls(fresh=np.zeros(n, np.bool_), cpu=np.zeros(n), memory=np.zeros(n),
                  cpu_peak=np.zeros(n), memory_peak=np.zeros(n),
                  base_cpu=np.zeros(n, np.int64), base_memory=np.zeros(n, np.int64),
                  gpu_util=np.zeros((n, g)), base_gpu=np.zeros((n, g), np.int64),
                  has_gpu_util=np.zeros((n, g), np.bool_))
        for i, load in enumerate(state.loads):
            if load is not None and 0.0 <= load.age_seconds <= expiry:
                out._fill(state, i, load)
        return out

    def _fill(self, state: ClusterState, i: int, load: NodeLoad) -> None:
        self.fresh[i] = True
        self.cpu[i], self.memory[i] = load.cpu_milli, load.memory_bytes
        self.cpu_peak[i], self.memory_peak[i] = load.cpu_peak_milli, load.memory_peak_bytes
        self.base_cpu[i] = load.requested_cpu_milli
        self.base_memory[i] = load.requested_memory_bytes
        for col, index in enumerate(state.gpu_index[i]):
            if index in load.gpu_util:
                self.gpu_util[i, col] = load.gpu_util[index]
                self.has_gpu_util[i, col] = True
                self.base_gpu[i, col] = load.gpu_requested_milli.get(index, 0)


def set_loads(state: ClusterState, loads: Sequence[NodeLoad | None]) -> None:
    """Replace the state's loads (the simulator does, as new samples arrive)."""
    if len(loads) != state.num_nodes:
        raise ValueError("one load per node")
    state.loads = list(loads)
    for key in [k for k in state.extensions if k.startswith(_CACHE_KEY)]:
        del state.extensions[key]


def load_arrays(state: ClusterState, expiry: float) -> LoadArrays:
    """The arrays for ``state`` (built once per state and expiry)."""
    key = f"{_CACHE_KEY}:{expiry}"
    found = state.extensions.get(key)
    if not isinstance(found, LoadArrays):
        found = LoadArrays.build(state, expiry)
        state.extensions[key] = found
    return found


@dataclass(frozen=True)
class Estimated:
    """Per candidate node: CPU and memory use once the pod is there (smoothed and peak)."""

    cpu: FloatArray
    memory: FloatArray
    cpu_peak: FloatArray
    memory_peak: FloatArray
    fresh: BoolArray


def estimated(cycle: Cycle, state: ClusterState, nodes: IntArray, factors: Factors,
              expiry: float) -> Estimated:
    """Load + in-flight placements + the incoming pod, per node of ``nodes``.

    A node without fresh metrics counts every pod it holds at its estimate (fail-open)."""
    arrays = load_arrays(state, expiry)
    cpu_req = state.cpu_cap[nodes] - state.cpu_free[nodes]
    mem_req = state.mem_cap[nodes] - state.mem_free[nodes]
    fresh = arrays.fresh[nodes]
    base_cpu = np.where(fresh, arrays.base_cpu[nodes], 0)
    base_mem = np.where(fresh, arrays.base_memory[nodes], 0)
    flight_cpu = np.maximum(cpu_req - base_cpu, 0) * factors.cpu + cycle.cpu_milli * factors.cpu
    flight_mem = (np.maximum(mem_req - base_mem, 0) * factors.memory
                  + cycle.memory_bytes * factors.memory)
    return Estimated(arrays.cpu[nodes] + flight_cpu, arrays.memory[nodes] + flight_mem,
                     arrays.cpu_peak[nodes] + flight_cpu, arrays.memory_peak[nodes] + flight_mem,
                     fresh)


def gpu_busy(cycle: Cycle, state: ClusterState, nodes: IntArray, expiry: float) -> FloatArray:
    """Per node, the least busy GPU (percent) that can take the share, after the share;
    NaN where no GPU of the node reports utilisation."""
    arrays = load_arrays(state, expiry)
    grown = np.maximum(FULL_GPU_MILLI - state.gpu_free[nodes] - arrays.base_gpu[nodes], 0)
    util = arrays.gpu_util[nodes] + (grown + cycle.milli) * (GPU_FACTOR * 100 / FULL_GPU_MILLI)
    usable = (cycle.eligible[nodes] & (state.gpu_free[nodes] >= cycle.milli)
              & arrays.has_gpu_util[nodes] & arrays.fresh[nodes][:, None])
    masked = np.where(usable, util, np.inf)
    best = masked.min(axis=1) if masked.shape[1] else np.full(nodes.size, np.inf)
    return np.where(np.isfinite(best), best, np.nan)


class LoadAwareScore:
    """Higher where the node keeps more of its CPU and memory (and, for a GPU share, the
    chosen GPU more of its time) free after the pod: 100 × weighted free fraction.

    Args: ``cpu_weight``, ``memory_weight``, ``gpu_weight`` (1 each), ``cpu_factor``,
    ``memory_factor`` (percent), ``expiry_seconds``.
    """

    name = "LoadAware"

    def __init__(self, args: PluginArgs) -> None:
        self.factors = Factors.from_args(args)
        self.expiry = float(args.get("expiry_seconds", EXPIRY_SECONDS))
        self.weights = (float(args.get("cpu_weight", 1.0)), float(args.get("memory_weight", 1.0)),
                        float(args.get("gpu_weight", 1.0)))

    def score(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> FloatArray:
        est = estimated(cycle, state, nodes, self.factors, self.expiry)
        w_cpu, w_mem, w_gpu = self.weights
        total = (w_cpu * _free(est.cpu, state.cpu_cap[nodes])
                 + w_mem * _free(est.memory, state.mem_cap[nodes]))
        weight = np.full(nodes.size, w_cpu + w_mem)
        if cycle.milli and w_gpu:
            busy = gpu_busy(cycle, state, nodes, self.expiry)
            known = ~np.isnan(busy)
            total = total + np.where(known, w_gpu * np.clip(1 - busy / 100, 0, 1), 0.0)
            weight = weight + np.where(known, w_gpu, 0.0)
        return np.asarray(MAX_SCORE * total / np.maximum(weight, 1e-12), np.float64)


def _free(used: FloatArray, capacity: IntArray) -> FloatArray:
    cap = np.maximum(capacity, 1).astype(np.float64)
    return np.asarray(np.clip((cap - used) / cap, 0.0, 1.0), np.float64)


def over_threshold(used: FloatArray, capacity: IntArray, percent: float) -> BoolArray:
    """Where ``used`` is more than ``percent`` of ``capacity``."""
    return np.asarray(used * 100.0 > percent * np.maximum(capacity, 1), np.bool_)


def load_reason(resource: str, percent: float) -> str:
    return f"{resource} load would exceed {percent:g} %"


EXPIRED = "node load metrics expired"


class LoadAwareFilter:
    """Rejects a node where the pod would take the peak (max of recent samples) use over a
    threshold: ``cpu_threshold`` 65 %, ``memory_threshold`` 95 %, ``gpu_threshold`` (off;
    percent of a shared GPU). Nodes without fresh metrics pass (``fail_closed``: rejected).
    """

    name = "LoadAwareFilter"

    def __init__(self, args: PluginArgs) -> None:
        self.factors = Factors.from_args(args)
        self.expiry = float(args.get("expiry_seconds", EXPIRY_SECONDS))
        self.cpu = _percent(args, "cpu_threshold", CPU_THRESHOLD)
        self.memory = _percent(args, "memory_threshold", MEMORY_THRESHOLD)
        gpu = args.get("gpu_threshold")
        self.gpu = None if gpu is None else _percent(args, "gpu_threshold", 100.0)
        self.fail_closed = bool(args.get("fail_closed", False))

    def filter(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> Rejections:
        est = estimated(cycle, state, nodes, self.factors, self.expiry)
        out: Rejections = []
        if self.fail_closed:
            out.append((EXPIRED, ~est.fresh))
        cpu = est.fresh & over_threshold(est.cpu_peak, state.cpu_cap[nodes], self.cpu)
        memory = est.fresh & over_threshold(est.memory_peak, state.mem_cap[nodes], self.memory)
        out += [(load_reason("CPU", self.cpu), cpu), (load_reason("memory", self.memory), memory)]
        if self.gpu is not None and cycle.milli:
            busy = gpu_busy(cycle, state, nodes, self.expiry)
            out.append((load_reason("GPU", self.gpu), np.nan_to_num(busy, nan=0.0) > self.gpu))
        return out
