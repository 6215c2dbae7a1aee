"""The placement policies of the FGD paper (ATC '23) as score + GPU-choice plugins.

Each reproduces the published simulator's rule, including its integer score rounding (which
decides how many nodes tie; ties are broken at random like the Kubernetes scheduler):

* ``Random`` — a uniformly random feasible node;
* ``DotProduct`` — Tetris-style alignment of the node's free (CPU, GPU) vector with the
  request, both normalised by the largest node spec; the smallest product wins;
* ``GpuClustering`` — prefers nodes already running pods of the same GPU shape;
* ``GpuPacking`` — prefers shared GPUs, then partly used nodes, then idle nodes;
* ``BestFit`` — the node with the least free (CPU, GPU) left after placement;
* ``FGD`` lives in ``plugins/fgd.py``.
"""

from __future__ import annotations

import numpy as np

from gpucloud.scheduler.framework.cluster import Allocation, ClusterState, FloatArray, IntArray
from gpucloud.scheduler.framework.plugin import Cycle
from gpucloud.scheduler.framework.registry import PluginArgs
from gpucloud.scheduler.plugins.filters import usable_free
from gpucloud.scheduler.types import FULL_GPU_MILLI

MAX_SCORE = 100
MAX_SPEC_CPU = 128_000
MAX_SPEC_GPU = 8_000


def normalize_int(raw: IntArray) -> IntArray:
    """The simulator's integer min-max normalisation to 0..100 (creates ties on purpose)."""
    low, high = int(raw.min()), int(raw.max())
    if high == low:
        return np.zeros_like(raw)
    return (raw - low) * MAX_SCORE // (high - low)


class RandomScore:
    """One feasible node, drawn uniformly, gets the top score."""

    name = "Random"

    def __init__(self, _args: PluginArgs) -> None:
        pass

    def score(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> FloatArray:
        del state
        out = np.zeros(nodes.size, np.float64)
        out[cycle.rng.integers(nodes.size)] = MAX_SCORE
        return out


class DotProductScore:
    name = "DotProduct"
    node_local = True  # see scheduler/framework/tables.py

    def __init__(self, _args: PluginArgs) -> None:
        pass

    def score(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> FloatArray:
        cpu = state.cpu_free[nodes] / MAX_SPEC_CPU * (cycle.cpu_milli / MAX_SPEC_CPU)
        gpu = state.free_milli[nodes] / MAX_SPEC_GPU * (cycle.gpu_request_milli / MAX_SPEC_GPU)
        return np.floor(MAX_SCORE * (1.0 - (cpu + gpu) / 2.0))


def gpu_shape_tag(cycle: Cycle) -> int:
    """The clustering tag of a pod: 0 no GPU, -1 a shared GPU, k for k whole GPUs."""
    if cycle.whole:
        return cycle.whole
    return -1 if cycle.milli else 0


class GpuClusteringScore:
    """Same-shape pods together: 4 bands (only this shape / mixed incl. it / idle / other),
    within a band fuller nodes first. Node shape tags are kept by ``ShapeTracker``."""

    name = "GpuClustering"
    node_local = True  # see scheduler/framework/tables.py

    def __init__(self, _args: PluginArgs) -> None:
        pass

    def score(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> FloatArray:
        tag = gpu_shape_tag(cycle)
        if tag == 0:
            return np.zeros(nodes.size, np.float64)
        fill = (MAX_SCORE // 4) * (MAX_SPEC_GPU - state.free_milli[nodes]) // MAX_SPEC_GPU
        tags = shape_tags(state)
        count = tags.count(nodes, tag)
        kinds = tags.kinds(nodes)
        band = np.where(count > 0, np.where(kinds == 1, 3, 2), np.where(kinds == 0, 1, 0))
        return np.asarray(fill + band * (MAX_SCORE // 4), np.float64)

    def committed(self, cycle: Cycle, state: ClusterState, allocation: Allocation) -> None:
        shape_tags(state).add(allocation.node, gpu_shape_tag(cycle))


class ShapeTags:
    """Per node, how many pods of each GPU shape it runs (for GpuClustering)."""

    MAX_WHOLE = 16

    def __init__(self, num_nodes: int) -> None:
        self._counts = np.zeros((num_nodes, self.MAX_WHOLE + 2), np.int64)

    def _column(self, tag: int) -> int:
        return self.MAX_WHOLE + 1 if tag < 0 else min(tag, self.MAX_WHOLE)

    def count(self, nodes: IntArray, tag: int) -> IntArray:
        return np.asarray(self._counts[nodes, self._column(tag)], np.int64)

    def kinds(self, nodes: IntArray) -> IntArray:
        return np.asarray((self._counts[nodes, 1:] > 0).sum(axis=1), np.int64)

    def add(self, node: int, tag: int) -> None:
        if tag != 0:
            self._counts[node, self._column(tag)] += 1


def shape_tags(state: ClusterState) -> ShapeTags:
    """The shape tags attached to a cluster state (created empty on first use)."""
    found = state.extensions.get("shape_tags")
    if not isinstance(found, ShapeTags):
        found = ShapeTags(state.num_nodes)
        state.extensions["shape_tags"] = found
    return found


class GpuPackingScore:
    """Shared GPUs first (100 − free%/10 of the GPUs used), then free GPUs on used nodes
    (50 − GPUs used), then idle nodes (33 − their GPU count)."""

    name = "GpuPacking"
    node_local = True  # see scheduler/framework/tables.py

    def __init__(self, _args: PluginArgs) -> None:
        pass

    def score(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> FloatArray:
        if not (cycle.whole or cycle.milli):
            return np.zeros(nodes.size, np.float64)
        free = usable_free(cycle, state, nodes)
        full = state.full_free[nodes]
        idle = full == state.gpu_count[nodes]
        out = np.maximum(MAX_SCORE // 3 - full, full)
        if cycle.whole:
            used_node = np.maximum(MAX_SCORE // 2 - cycle.whole, MAX_SCORE // 3)
            return np.where(idle, out, used_node).astype(np.float64)
        fits = np.where(free >= cycle.milli, free, FULL_GPU_MILLI + 1)
        best = fits.min(axis=1)  # least free GPU that fits: what packing picks
        shared = np.maximum(MAX_SCORE - (best * 100 // FULL_GPU_MILLI) // 10, MAX_SCORE // 2)
        partial = np.where(best == FULL_GPU_MILLI, MAX_SCORE // 2 - 1, shared)
        return np.where(idle, out, partial).astype(np.float64)


class BestFitScore:
    """(1 − Σ weights·(free − request)/max spec) · 100 over (CPU, GPU), then normalised."""

    name = "BestFit"

    def __init__(self, _args: PluginArgs) -> None:
        pass

    def score(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> FloatArray:
        cpu = (state.cpu_free[nodes] - cycle.cpu_milli) / MAX_SPEC_CPU * 0.5
        gpu = (state.free_milli[nodes] - cycle.gpu_request_milli) / MAX_SPEC_GPU * 0.5
        raw = ((1.0 - (cpu + gpu)) * MAX_SCORE).astype(np.int64)
        return normalize_int(raw).astype(np.float64)
