"""Working copy of a cluster as numpy arrays, shared by the live scheduler and the simulator.

One row per node, one column per GPU slot (``G`` = most GPUs on any node; missing GPUs have
``gpu_exists`` false and no free capacity). Per-node summaries (``full_free``, ``max_free``)
are kept up to date on every commit so that filters are a handful of vector comparisons
instead of a scan of every GPU of every node per pod.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gpucloud.core.gpu_models import canonical_name, lookup
from gpucloud.scheduler.mig import MIG_SLOTS, mig_capable_model
from gpucloud.scheduler.types import FULL_GPU_MILLI, GpuState, NodeLoad, NodeState

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Allocation:
    """What one placement takes on one node (the unit ``ClusterState.commit`` applies)."""

    node: int
    gpu_milli: dict[int, int]
    cpu_milli: int
    memory_bytes: int
    mig_slices: dict[int, int] | None = None  # GPU column -> bitmask of MIG memory slices
    #: A share's device memory limit, taken on each GPU of ``gpu_milli``.
    gpu_memory_mib: int = 0


def _nvlink_domains(gpus: Sequence[GpuState]) -> list[int]:
    """Connected components of the NVLink peer graph, numbered by their smallest index."""
    return list(_nvlink_components(tuple((gpu.index, gpu.nvlink_peers) for gpu in gpus)))


@functools.lru_cache(maxsize=256)
def _nvlink_components(links: tuple[tuple[int, tuple[int, ...]], ...]) -> tuple[int, ...]:
    """Memoised on the peer graph: a fleet has few distinct GPU topologies (every DGX H100
    is alike), and building a 10,000-node snapshot recomputed the same ones each time."""
    position = {index: i for i, (index, _) in enumerate(links)}
    parent = list(range(len(links)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, (_, peers) in enumerate(links):
        for peer in peers:
            j = position.get(peer)
            if j is not None:
                parent[find(i)] = find(j)
    return tuple(find(i) for i in range(len(links)))


class ClusterState:
    """Mutable arrays describing free capacity; built once, then updated by ``commit``."""

    def __init__(self, num_nodes: int, max_gpus: int) -> None:
        n, g = num_nodes, max(max_gpus, 1)
        self.names: list[str] = [""] * n
        self.labels: list[dict[str, str]] = [{} for _ in range(n)]
        self.gpu_index: list[list[int]] = [[] for _ in range(n)]
        self.model_names: list[str] = []
        self._model_ids: dict[str, int] = {}
        self.cpu_cap = np.zeros(n, np.int64)
        self.cpu_free = np.zeros(n, np.int64)
        self.mem_cap = np.zeros(n, np.int64)
        self.mem_free = np.zeros(n, np.int64)
        self.ready = np.ones(n, np.bool_)
        self.cordoned = np.zeros(n, np.bool_)
        self.gpu_exists = np.zeros((n, g), np.bool_)
        self.gpu_free = np.zeros((n, g), np.int64)
        self.gpu_model = np.full((n, g), -1, np.int64)
        self.gpu_mem_mib = np.zeros((n, g), np.int64)
        self.numa = np.zeros((n, g), np.int64)
        self.nvlink = np.zeros((n, g), np.int64)
        self.pcie = np.zeros((n, g), np.int64)
        self.mig_capable = np.zeros((n, g), np.bool_)
        self.mig_used = np.zeros((n, g), np.int64)
        self.mig_mode = np.zeros((n, g), np.bool_)  # MIG pods may go here (not off)
        self.mig_on = np.zeros((n, g), np.bool_)  # reported on: MIG pods only
        # 0: instances are made as pods come (dynamic); k: fixed layout ``mig_layouts[k-1]``
        self.mig_layout_id = np.zeros((n, g), np.int64)
        self.mig_layouts: list[tuple[tuple[str, int], ...]] = []
        # Device memory not yet promised to shares' limits (MiB).
        self.gpu_mem_free = np.zeros((n, g), np.int64)
        self.gpu_count = np.zeros(n, np.int64)
        self.node_model = np.full(n, -1, np.int64)
        self.full_free = np.zeros(n, np.int64)
        self.max_free = np.zeros(n, np.int64)
        self.free_milli = np.zeros(n, np.int64)
        self.node_version = np.zeros(n, np.int64)
        # Nodes alike as loaded (same free GPUs, CPU, memory, model) share a class id. It
        # describes a node while its version is still 0, so per-node caches can compute
        # once per class instead of once per node.
        self.node_class = np.zeros(n, np.int64)
        self.num_classes = 1
        # Observed use per node (static for a pass; ``loadaware.set_loads`` replaces it).
        self.loads: list[NodeLoad | None] = [None] * n
        # Plugin-owned bookkeeping that must follow the state (e.g. shape tags per node).
        self.extensions: dict[str, object] = {}
        self.version = 0

    @property
    def num_nodes(self) -> int:
        return len(self.names)

    @property
    def max_gpus(self) -> int:
        return int(self.gpu_free.shape[1])

    def model_id(self, name: str) -> int:
        """Id of a GPU model (canonical name), registering it on first sight."""
        key = canonical_name(name)
        found = self._model_ids.get(key)
        if found is None:
            found = len(self.model_names)
            self._model_ids[key] = found
            self.model_names.append(key)
        return found

    def known_model_id(self, name: str) -> int | None:
        return self._model_ids.get(canonical_name(name))

    @classmethod
    def from_nodes(cls, nodes: Sequence[NodeState]) -> ClusterState:
        """Arrays for a snapshot; the snapshot objects themselves are not modified."""
        state = cls(len(nodes), max((len(node.gpus) for node in nodes), default=1))
        for i, node in enumerate(nodes):
            state._load_node(i, node)
        state.refresh_summaries()
        state.classify_nodes()
        return state

    def reloaded(self, old: Sequence[NodeState], new: Sequence[NodeState]) -> ClusterState | None:
        """The state ``from_nodes(new)`` would build, made from this one (built from ``old``,
        never committed to) by reloading only the rows whose ``NodeState`` is not the very
        same object: at 10,000 nodes a pass changes a few hundred, and loading every GPU of
        every node again was most of a pass. None when the rows do not line up (a node
        added or removed, more GPUs on a node than columns) or most rows changed: build
        afresh then."""
        if len(old) != len(new) or self.version or any(
                len(node.gpus) > self.max_gpus for node in new):
            return None
        changed = [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a is not b]
        if len(changed) > len(new) // 2 or any(old[i].name != new[i].name for i in changed):
            return None  # mostly new (the simulator's every step): a fresh build is cheaper
        state = self.copy()
        for i in changed:
            state._clear_row(i)
            state._load_node(i, new[i])
        if changed:
            state.refresh_summaries()
            state.classify_nodes()
        return state

    def _clear_row(self, i: int) -> None:
        """A row as ``__init__`` leaves it, before ``_load_node`` fills it again."""
        for name in ("gpu_exists", "gpu_free", "gpu_mem_mib", "numa", "nvlink", "pcie",
                     "mig_capable", "mig_used", "mig_mode", "mig_on", "mig_layout_id",
                     "gpu_mem_free"):
            getattr(self, name)[i] = 0
        self.gpu_model[i] = -1
        self.node_model[i] = -1

    def classify_nodes(self) -> None:
        """Group nodes whose loaded state is identical (see ``node_class``)."""
        if not self.num_nodes:
            return
        signature = np.column_stack((self.gpu_free, self.mig_used, self.gpu_model,
                                     self.mig_mode, self.mig_on, self.mig_layout_id,
                                     self.gpu_mem_free,
                                     self.cpu_free, self.mem_free, self.gpu_count))
        # Each row as one opaque value (its bytes): ``np.unique`` then compares rows with
        # one memcmp instead of column by column (``axis=0``), a few times faster on
        # 10,000 nodes. The ids only need to be equal for equal rows.
        rows = np.ascontiguousarray(signature)
        opaque = rows.view(np.dtype((np.void, rows.shape[1] * rows.itemsize))).reshape(-1)
        unique, inverse = np.unique(opaque, return_inverse=True)
        self.node_class = np.asarray(inverse, np.int64).reshape(-1)
        self.num_classes = int(unique.shape[0])

    def _load_node(self, i: int, node: NodeState) -> None:
        self.names[i] = node.name
        self.labels[i] = dict(node.labels)
        self.cpu_cap[i] = node.cpu_milli
        self.cpu_free[i] = node.cpu_milli - node.cpu_used_milli
        self.mem_cap[i] = node.memory_bytes
        self.mem_free[i] = node.memory_bytes - node.memory_used_bytes
        self.ready[i] = node.ready
        self.cordoned[i] = node.cordoned
        self.loads[i] = node.load
        self.gpu_count[i] = len(node.gpus)
        self.gpu_index[i] = [gpu.index for gpu in node.gpus]
        domains = _nvlink_domains(node.gpus)
        for col, gpu in enumerate(node.gpus):
            self._load_gpu(i, col, gpu, domains[col])
        if node.gpus:
            self.node_model[i] = self.gpu_model[i, 0]

    def _load_gpu(self, i: int, col: int, gpu: GpuState, domain: int) -> None:
        catalog = lookup(gpu.model)
        self.gpu_exists[i, col] = True
        self.gpu_model[i, col] = self.model_id(gpu.model)
        self.gpu_mem_mib[i, col] = gpu.memory_mib or (catalog.memory_mib if catalog else 0)
        self.numa[i, col] = gpu.numa_node
        self.nvlink[i, col] = domain
        self.pcie[i, col] = gpu.pcie_switch
        self.mig_capable[i, col] = mig_capable_model(canonical_name(gpu.model))
        mask = 0
        for slot in gpu.mig_used:
            if 0 <= slot < MIG_SLOTS:
                mask |= 1 << slot
        self.mig_used[i, col] = mask
        self.mig_mode[i, col] = gpu.mig_mode is not False
        self.mig_on[i, col] = gpu.mig_mode is True
        self.gpu_mem_free[i, col] = max(0, int(self.gpu_mem_mib[i, col]) - gpu.memory_used_mib)
        # A GPU in MIG mode (or with a fixed layout) has nothing for whole or shared pods.
        partitioned = gpu.mig_mode is True or (
            bool(gpu.mig_layout) and gpu.mig_mode is not False)
        if gpu.mig_layout is not None:
            self.mig_layout_id[i, col] = self._layout_id(gpu.mig_layout)
        used = FULL_GPU_MILLI if mask or partitioned else min(max(gpu.used_milli, 0),
                                                              FULL_GPU_MILLI)
        self.gpu_free[i, col] = FULL_GPU_MILLI - used

    def _layout_id(self, layout: tuple[tuple[str, int], ...]) -> int:
        key = tuple(sorted((name.strip().lower(), start) for name, start in layout))
        if key not in self.mig_layouts:
            self.mig_layouts.append(key)
        return self.mig_layouts.index(key) + 1

    def refresh_summaries(self, rows: int | None = None) -> None:
        """Recompute per-node summaries, for one row or for all."""
        sel: slice | int = slice(None) if rows is None else rows
        free = self.gpu_free[sel]
        self.full_free[sel] = (free == FULL_GPU_MILLI).sum(axis=-1)
        self.max_free[sel] = free.max(axis=-1)
        self.free_milli[sel] = free.sum(axis=-1)

    def commit(self, alloc: Allocation) -> None:
        """Take the resources of one placement (the caller has checked that they fit)."""
        i = alloc.node
        self.cpu_free[i] -= alloc.cpu_milli
        self.mem_free[i] -= alloc.memory_bytes
        for col, milli in alloc.gpu_milli.items():
            self.gpu_free[i, col] -= milli
            self.gpu_mem_free[i, col] -= alloc.gpu_memory_mib
        for col, mask in (alloc.mig_slices or {}).items():
            self.mig_used[i, col] |= mask
            self.gpu_free[i, col] = 0
        self.refresh_summaries(i)
        self.version += 1
        self.node_version[i] = self.version

    def copy(self) -> ClusterState:
        """An independent copy (arrays copied; static name lists shared)."""
        other = ClusterState.__new__(ClusterState)
        other.__dict__.update(self.__dict__)
        for key, value in self.__dict__.items():
            if isinstance(value, np.ndarray):
                other.__dict__[key] = value.copy()
            elif isinstance(value, list | dict):  # rows reloaded in one copy stay its own
                other.__dict__[key] = value.copy()
        other.extensions = {}
        return other
