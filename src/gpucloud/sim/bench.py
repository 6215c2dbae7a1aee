"""Placement throughput of the scheduler on a synthetic cluster (``gpucloud bench``).

N nodes of 8 H100 GPUs (one NVLink domain, two NUMA nodes, 128 cores, 2 TiB) receive a
mixed stream: the openb shapes (shares of one GPU, 1/2/4/8 whole GPUs, CPU-only pods)
plus 8-GPU and MIG pods. Each placement goes through the full cycle of the ``default``
profile against incrementally updated state; the cluster is large enough that the stream
never exhausts it, so every placement searches a realistic mix of busy and idle nodes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from gpucloud.core.jobs import Topology
from gpucloud.scheduler.framework.cluster import ClusterState
from gpucloud.scheduler.gang import place_gang
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


@dataclass(frozen=True)
class GangBenchResult:
    """Latency of ``place_gang`` for one gang size on one cluster layout."""

    nodes: int
    members: int
    layout: str
    repeats: int
    placed: bool
    p50_ms: float
    p99_ms: float

    def to_json(self) -> dict[str, float | int | str | bool]:
        return {"workload": "gang", "nodes": self.nodes, "members": self.members,
                "layout": self.layout, "repeats": self.repeats, "placed": self.placed,
                "p50_latency_ms": round(self.p50_ms, 3), "p99_latency_ms": round(self.p99_ms, 3)}


#: Cluster layouts of the gang benchmark: racks of 32 nodes in blocks of 256; the same
#: with a third of the nodes partly busy; no topology labels at all (the whole cluster is
#: the only domain, the worst case for the feasibility scan).
GANG_LAYOUTS = ("blocks", "blocks-busy", "flat")


def gang_cluster(count: int, layout: str, seed: int = 0) -> list[NodeState]:
    nodes = synthetic_nodes(count)
    rng = np.random.default_rng(seed)
    out = []
    for i, node in enumerate(nodes):
        labels = {} if layout == "flat" else {"block": f"b{i // 256}", "rack": f"r{i // 32}"}
        gpus = node.gpus
        if layout == "blocks-busy" and rng.random() < 1 / 3:
            used = int(rng.integers(1, 9))
            gpus = tuple(replace(g, used_milli=1000 if g.index < used else 0) for g in gpus)
        out.append(replace(node, labels=labels, gpus=gpus))
    return out


def run_gang_bench(nodes: int, members: int, layout: str = "blocks", repeats: int = 30,
                   policy: str = "default") -> GangBenchResult:
    """Time ``repeats`` placements of one ``members``-node gang of 8-GPU members."""
    cluster = gang_cluster(nodes, layout)
    gang = [PodRequest(f"m{i}", gpus=8, cpu_milli=64_000, memory_bytes=256 * GIB)
            for i in range(members)]
    scheduler = Scheduler(policy)
    latencies = np.zeros(repeats)
    placed = True
    for i in range(repeats):
        begin = time.perf_counter()
        decision = place_gang(scheduler, cluster, gang, Topology.ANY)
        latencies[i] = time.perf_counter() - begin
        placed &= decision.placements is not None
    return GangBenchResult(nodes, members, layout, repeats, placed,
                           float(np.percentile(latencies, 50)) * 1e3,
                           float(np.percentile(latencies, 99)) * 1e3)
