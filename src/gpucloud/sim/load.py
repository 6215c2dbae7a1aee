"""Load-aware placement experiment (``gpucloud sim load``): pods whose real use differs
from their requests, placed by ``default`` and by ``default+load-aware``.

Protocol (per seed): the openb node and pod lists, arrivals drawn as in the FGD protocol
(``engine.draw_arrivals``) up to ``tune`` x GPU capacity, one pod per simulated second,
never leaving. Each pod's real use is its request times a ratio drawn once per pod:

* CPU: with probability 0.7 a *light* pod, ratio ~ Beta(2, 5) (mean 0.29); else a
  *heavy* one, ratio ~ 1.2 x Beta(5, 2) (mean 0.86, up to 1.2: bursting over the request,
  as burstable pods do);
* memory: ratio ~ Beta(4, 3) (mean 0.57).

(A bimodal mix because that is what makes hot nodes: nodes with the same requests, some
holding heavy pods. Usage studies of the Alibaba and Google traces report mean CPU use well
under half of requests with a long tail above.) Nodes report every ``report_seconds``
(60 s): the scheduler then sees each node's real use (age 0); pods placed since are
estimated by the plugins from the growth of the node's requests (85 % / 70 %).

Reported per profile: hot nodes (real CPU or memory use above 80 % of capacity) at the
end, allocation rate (GPU allocated / capacity) and unallocated GPU % at arrived = 100 %,
so that load-awareness is seen next to packing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpucloud.scheduler.framework.cluster import ClusterState, FloatArray
from gpucloud.scheduler.plugins.loadaware import set_loads
from gpucloud.scheduler.scheduler import Scheduler
from gpucloud.scheduler.types import FULL_GPU_MILLI, NodeLoad, NodeState, PodRequest
from gpucloud.sim.engine import draw_arrivals

HOT_PERCENT = 80.0
LIGHT_SHARE = 0.7
REPORT_SECONDS = 60
PROFILES = ("default", "default+load-aware", "default+load-aware-filter")


@dataclass(frozen=True)
class LoadRun:
    profile: str
    seed: int
    nodes: int
    hot_nodes: int
    allocation_pct: float
    unallocated_gpu_pct: float
    placed_pct: float
    max_cpu_use_pct: float

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


def use_ratios(count: int, seed: int) -> tuple[FloatArray, FloatArray]:
    """(CPU, memory) real-use / request ratio per pod, from the documented mixture."""
    rng = np.random.default_rng(seed + 10_000)
    light = rng.random(count) < LIGHT_SHARE
    cpu = np.where(light, rng.beta(2, 5, count), 1.2 * rng.beta(5, 2, count))
    memory = rng.beta(4, 3, count)
    return np.asarray(cpu, np.float64), np.asarray(memory, np.float64)


def _loads(state: ClusterState, cpu: FloatArray, memory: FloatArray) -> list[NodeLoad | None]:
    """Fresh samples: the real use, with the requests it covers."""
    return [NodeLoad(0.0, float(cpu[i]), float(memory[i]), float(cpu[i]), float(memory[i]),
                     int(state.cpu_cap[i] - state.cpu_free[i]),
                     int(state.mem_cap[i] - state.mem_free[i]))
            for i in range(state.num_nodes)]


def run_load(nodes: Sequence[NodeState], pods: Sequence[PodRequest], profile: str, seed: int,
             tune: float = 1.0, report_seconds: int = REPORT_SECONDS) -> LoadRun:
    """One run of one profile (pods arrive one per simulated second)."""
    state = ClusterState.from_nodes(nodes)
    capacity = int(state.gpu_exists.sum()) * FULL_GPU_MILLI
    framework = Scheduler(profile, seed=seed).framework(state, pods)
    cpu_ratio, mem_ratio = use_ratios(len(pods), seed)
    real_cpu = np.zeros(state.num_nodes)
    real_mem = np.zeros(state.num_nodes)
    order = draw_arrivals(pods, capacity, tune, seed)
    allocated = placed = 0
    set_loads(state, _loads(state, real_cpu, real_mem))
    for second, index in enumerate(order, start=1):
        pod = pods[index]
        outcome = framework.schedule(pod)
        if outcome.allocation is not None:
            node = outcome.allocation.node
            real_cpu[node] += pod.cpu_milli * cpu_ratio[index]
            real_mem[node] += pod.memory_bytes * mem_ratio[index]
            allocated += pod.gpu_request_milli
            placed += 1
        if second % report_seconds == 0:
            set_loads(state, _loads(state, real_cpu, real_mem))
    cpu_pct = 100 * real_cpu / np.maximum(state.cpu_cap, 1)
    mem_pct = 100 * real_mem / np.maximum(state.mem_cap, 1)
    hot = int(((cpu_pct > HOT_PERCENT) | (mem_pct > HOT_PERCENT)).sum())
    return LoadRun(profile, seed, state.num_nodes, hot, 100.0 * allocated / capacity,
                   100.0 * (capacity - allocated) / capacity, 100.0 * placed / len(order),
                   float(cpu_pct.max(initial=0.0)))
