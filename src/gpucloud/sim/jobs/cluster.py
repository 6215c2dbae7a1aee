"""The simulated cluster: one ``ClusterState`` placed into by the scheduler library.

Jobs no wider than a node are ordinary pods placed by the profile's ``Framework`` (what
``Scheduler.schedule`` runs); wider jobs are gangs of whole nodes placed by ``place_gang``
on the nodes that are entirely free. Finished jobs give their allocations back
(``release``), which bumps the node versions so that the scorers' caches see the change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gpucloud.core.jobs import Topology
from gpucloud.scheduler.framework.cluster import Allocation, BoolArray, ClusterState
from gpucloud.scheduler.framework.runner import Framework
from gpucloud.scheduler.gang import place_gang
from gpucloud.scheduler.scheduler import Scheduler
from gpucloud.scheduler.types import FULL_GPU_MILLI, GpuState, NodeState, PodRequest
from gpucloud.sim.jobs.trace import TraceJob

GIB = 1024**3
CPU_PER_GPU = 8_000
MEMORY_PER_GPU = 64 * GIB
#: Nodes per rack label: gangs prefer one rack, as ``place_gang`` does for real jobs.
RACK_SIZE = 8


@dataclass(frozen=True)
class Shape:
    """How a job is placed: ``members`` pods of ``gpus`` GPUs (one member: a plain pod)."""

    members: int
    gpus: int

    @property
    def is_gang(self) -> bool:
        return self.members > 1

    @property
    def allocated(self) -> int:
        return self.members * self.gpus


def shape_of(job: TraceJob, gpus_per_node: int) -> Shape:
    """A job wider than a node becomes a gang of whole nodes (rounded up)."""
    if job.gpus <= gpus_per_node:
        return Shape(1, max(job.gpus, 1))
    return Shape(math.ceil(job.gpus / gpus_per_node), gpus_per_node)


def synthetic_nodes(count: int, gpus_per_node: int) -> list[NodeState]:
    """Identical nodes of ``gpus_per_node`` GPUs, one NVLink domain, racks of eight."""
    return [NodeState(f"node-{i:04d}", CPU_PER_GPU * gpus_per_node,
                      MEMORY_PER_GPU * gpus_per_node, _idle_gpus(gpus_per_node),
                      labels={"rack": f"r{i // RACK_SIZE}"})
            for i in range(count)]


def _idle_gpus(count: int) -> tuple[GpuState, ...]:
    peers = tuple(range(count))
    return tuple(GpuState(i, f"gpu-{i}", "V100-32GB", 32_768, numa_node=i * 2 // count,
                          nvlink_peers=peers) for i in range(count))


def member_pod(key: str, gpus: int) -> PodRequest:
    return PodRequest(key, gpus=gpus, cpu_milli=CPU_PER_GPU * gpus,
                      memory_bytes=MEMORY_PER_GPU * gpus)


class SimCluster:
    """Placement and release on the simulated cluster, plus cheap "could it fit" checks."""

    def __init__(self, nodes: int, gpus_per_node: int, scheduler: Scheduler,
                 workload: list[PodRequest]) -> None:
        self.gpus_per_node = gpus_per_node
        self.node_list = synthetic_nodes(nodes, gpus_per_node)
        self.state = ClusterState.from_nodes(self.node_list)
        self.scheduler = scheduler
        self.framework: Framework = scheduler.framework(self.state, workload)
        self.index = {name: i for i, name in enumerate(self.state.names)}

    @property
    def total_gpus(self) -> int:
        return len(self.node_list) * self.gpus_per_node

    def open_nodes(self) -> BoolArray:
        return ~self.state.cordoned

    def could_fit(self, shape: Shape) -> bool:
        """A necessary condition checked on the per-node summaries (no plugin runs)."""
        free = self.state.full_free[self.open_nodes()]
        if shape.is_gang:
            return int((free >= self.gpus_per_node).sum()) >= shape.members
        return bool((free >= shape.gpus).any())

    def place(self, key: str, shape: Shape) -> list[Allocation] | None:
        """Place and commit a job, or nothing."""
        if not self.could_fit(shape):
            return None
        if not shape.is_gang:
            outcome = self.framework.schedule(member_pod(key, shape.gpus))
            return None if outcome.allocation is None else [outcome.allocation]
        return self._place_gang(key, shape)

    def _place_gang(self, key: str, shape: Shape) -> list[Allocation] | None:
        free = np.flatnonzero(self.open_nodes() & (self.state.full_free >= self.gpus_per_node))
        candidates = [self.node_list[int(i)] for i in free]  # entirely free: as loaded
        members = [member_pod(f"{key}-{r}", shape.gpus) for r in range(shape.members)]
        decision = place_gang(self.scheduler, candidates, members, Topology.ANY)
        if decision.placements is None:
            return None
        allocations = []
        for member, placement in zip(members, decision.placements, strict=True):
            node = self.index[placement.node]
            cols = {self.state.gpu_index[node].index(g): m for g, m in placement.gpu_milli.items()}
            allocations.append(Allocation(node, cols, member.cpu_milli, member.memory_bytes))
            self.state.commit(allocations[-1])
        return allocations

    def release(self, allocations: list[Allocation]) -> None:
        """Give a finished job's resources back."""
        state = self.state
        for alloc in allocations:
            state.cpu_free[alloc.node] += alloc.cpu_milli
            state.mem_free[alloc.node] += alloc.memory_bytes
            for col, milli in alloc.gpu_milli.items():
                state.gpu_free[alloc.node, col] = min(
                    state.gpu_free[alloc.node, col] + milli, FULL_GPU_MILLI)
            state.refresh_summaries(alloc.node)
            state.version += 1
            state.node_version[alloc.node] = state.version
