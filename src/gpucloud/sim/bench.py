"""Placement throughput of the scheduler on a synthetic cluster (``gpucloud bench``).

N nodes of 8 H100 GPUs (one NVLink domain, two NUMA nodes, 128 cores, 2 TiB) receive a
mixed stream: the openb shapes (shares of one GPU, 1/2/4/8 whole GPUs, CPU-only pods)
plus 8-GPU and MIG pods. Each placement goes through the full cycle of the ``default``
profile against incrementally updated state; the cluster is large enough that the stream
never exhausts it, so every placement searches a realistic mix of busy and idle nodes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from gpucloud.scheduler.framework.cluster import ClusterState
from gpucloud.scheduler.scheduler import Scheduler
from gpucloud.scheduler.types import GpuState, NodeState, PodRequest

GIB = 1024**3

# (weight, gpus, gpu_milli, cpu_milli, mig_profile) — shares and small whole-GPU pods
# dominate, as in the openb trace.
MIX: tuple[tuple[float, int, int, int, str | None], ...] = (
    (0.12, 0, 0, 4_000, None), (0.10, 0, 250, 4_000, None), (0.10, 0, 470, 8_000, None),
    (0.10, 0, 810, 3_000, None), (0.25, 1, 0, 12_000, None), (0.07, 2, 0, 24_000, None),
    (0.05, 4, 0, 48_000, None), (0.04, 8, 0, 96_000, None), (0.10, 0, 0, 2_000, "1g.10gb"),
    (0.07, 0, 0, 8_000, "3g.40gb"),
)


def synthetic_nodes(count: int) -> list[NodeState]:
    peers = tuple(range(8))
    gpus = tuple(GpuState(i, f"gpu-{i}", "H100-80GB", 81_559, numa_node=i // 4,
                          nvlink_peers=peers) for i in range(8))
    return [NodeState(f"node-{i:05d}", 128_000, 2048 * GIB, gpus) for i in range(count)]


def synthetic_pods(count: int, seed: int = 0) -> list[PodRequest]:
    rng = np.random.default_rng(seed)
    weights = np.array([m[0] for m in MIX])
    picks = rng.choice(len(MIX), size=count, p=weights / weights.sum())
    pods = []
    for i, pick in enumerate(picks):
        _, gpus, milli, cpu, mig = MIX[int(pick)]
        pods.append(PodRequest(f"pod-{i}", gpus=gpus, gpu_milli=milli, cpu_milli=cpu,
                               memory_bytes=cpu // 1000 * 4 * GIB, mig_profile=mig))
    return pods


@dataclass(frozen=True)
class BenchResult:
    nodes: int
    pods: int
    placed: int
    seconds: float
    p50_ms: float
    p99_ms: float
    setup_seconds: float

    @property
    def placements_per_s(self) -> float:
        return self.pods / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict[str, float | int]:
        return {"nodes": self.nodes, "pods": self.pods, "placed": self.placed,
                "placements_per_s": round(self.placements_per_s, 1),
                "p50_latency_ms": round(self.p50_ms, 4), "p99_latency_ms": round(self.p99_ms, 4),
                "seconds": round(self.seconds, 3), "setup_seconds": round(self.setup_seconds, 3)}


def run_bench(nodes: int, pods: int, policy: str = "default", seed: int = 0) -> BenchResult:
    """Time ``pods`` placements on ``nodes`` synthetic nodes (setup timed separately)."""
    started = time.perf_counter()
    stream = synthetic_pods(pods, seed)
    state = ClusterState.from_nodes(synthetic_nodes(nodes))
    framework = Scheduler(policy, seed=seed).framework(state, stream)
    setup = time.perf_counter() - started
    latencies = np.zeros(pods)
    placed = 0
    for i, pod in enumerate(stream):
        begin = time.perf_counter()
        outcome = framework.schedule(pod)
        latencies[i] = time.perf_counter() - begin
        placed += outcome.allocation is not None
    total = float(latencies.sum())
    return BenchResult(nodes, pods, placed, total, float(np.percentile(latencies, 50)) * 1e3,
                       float(np.percentile(latencies, 99)) * 1e3, setup)
