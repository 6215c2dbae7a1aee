"""Topology score: a multi-GPU pod prefers a node where it fits in one NVLink domain,
then one NUMA node; single-GPU and CPU-only pods are indifferent (score 0 everywhere)."""

from __future__ import annotations

import numpy as np

from gpucloud.scheduler.framework.cluster import ClusterState, FloatArray, IntArray
from gpucloud.scheduler.framework.plugin import Cycle
from gpucloud.scheduler.framework.registry import PluginArgs
from gpucloud.scheduler.plugins.filters import usable_free
from gpucloud.scheduler.types import FULL_GPU_MILLI

SAME_NVLINK = 100.0
SAME_NUMA = 50.0


def _largest_group(free_full: np.ndarray, groups: np.ndarray) -> IntArray:
    """Per node, the most free GPUs that share one group id."""
    best = np.zeros(free_full.shape[0], np.int64)
    for group in range(int(groups.max(initial=0)) + 1):
        best = np.maximum(best, (free_full & (groups == group)).sum(axis=1))
    return best


class TopologyScore:
    name = "Topology"
    node_local = True  # see scheduler/framework/tables.py

    def __init__(self, _args: PluginArgs) -> None:
        pass

    def score(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> FloatArray:
        out = np.zeros(nodes.size, np.float64)
        if cycle.whole < 2:
            return out
        free_full = usable_free(cycle, state, nodes) == FULL_GPU_MILLI
        numa_ok = _largest_group(free_full, state.numa[nodes]) >= cycle.whole
        nvlink_ok = _largest_group(free_full, state.nvlink[nodes]) >= cycle.whole
        out[numa_ok] = SAME_NUMA
        out[nvlink_ok] = SAME_NVLINK
        return out
