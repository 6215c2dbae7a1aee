"""Reserve plugins: choose the GPUs on the chosen node and build the ``Allocation``.

Whole GPUs prefer one NVLink domain, then one NUMA node (best fit on domains, so big
domains stay whole for big pods). Shares go to the GPU the strategy picks; MIG instances to
a GPU already in MIG mode if possible, at the start slot that keeps the most room.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpucloud.scheduler.framework.cluster import Allocation, ClusterState, IntArray
from gpucloud.scheduler.framework.plugin import Cycle
from gpucloud.scheduler.framework.registry import PluginArgs
from gpucloud.scheduler.mig import remaining_room
from gpucloud.scheduler.plugins.filters import mig_start, usable_free
from gpucloud.scheduler.types import FULL_GPU_MILLI

ShareChooser = Callable[[Cycle, ClusterState, int, IntArray], int]


def _group_pick(cols: IntArray, groups: IntArray, k: int) -> list[int] | None:
    """``k`` columns within one group, the fullest group that still fits (best fit; among
    equals the lowest group id). On a node's few GPUs plain lists beat array masks."""
    members: dict[int, list[int]] = {}
    for col, group in zip(cols.tolist(), groups.tolist(), strict=True):
        members.setdefault(group, []).append(col)
    best: list[int] | None = None
    for group in sorted(members):
        found = members[group]
        if len(found) >= k and (best is None or len(found) < len(best)):
            best = found
    return best[:k] if best is not None else None


def pick_whole(state: ClusterState, node: int, cols: IntArray, k: int) -> list[int]:
    """``k`` of the free columns ``cols``, topology-aware (NVLink, then NUMA)."""
    for groups in (state.nvlink[node, cols], state.numa[node, cols]):
        picked = _group_pick(cols, groups, k)
        if picked is not None:
            return picked
    numa = state.numa[node, cols]
    sizes = np.array([(numa == g).sum() for g in numa])
    order = np.lexsort((cols, -sizes))
    return [int(c) for c in cols[order][:k]]


def share_best_fit(cycle: Cycle, state: ClusterState, node: int, free: IntArray) -> int:
    """The GPU with the least free share that still fits (lowest index on ties)."""
    del state, node
    fits = np.flatnonzero(free >= cycle.milli)
    return int(fits[np.argmin(free[fits])])


def share_worst_fit(cycle: Cycle, state: ClusterState, node: int, free: IntArray) -> int:
    """The GPU with the most free share."""
    del cycle, state, node
    return int(np.argmax(free))


def share_random(cycle: Cycle, state: ClusterState, node: int, free: IntArray) -> int:
    """A uniformly random GPU among those the share fits on."""
    del state, node
    fits = np.flatnonzero(free >= cycle.milli)
    return int(fits[cycle.rng.integers(fits.size)])


SHARE_STRATEGIES: dict[str, ShareChooser] = {
    "bestfit": share_best_fit,
    "worstfit": share_worst_fit,
    "random": share_random,
}


def pick_mig(cycle: Cycle, state: ClusterState, node: int) -> tuple[int, int] | None:
    """(column, start slot) for a MIG instance, preferring GPUs already in MIG mode."""
    best: tuple[tuple[int, int, int], int, int] | None = None
    for col in np.flatnonzero(cycle.eligible[node]):
        geom = cycle.mig_by_model.get(int(state.gpu_model[node, col]))
        if geom is None:
            continue
        used = int(state.mig_used[node, col])
        in_mig = bool(state.mig_layout_id[node, col]) or bool(state.mig_on[node, col])
        if used == 0 and not in_mig and state.gpu_free[node, col] != FULL_GPU_MILLI:
            continue
        start = mig_start(cycle, state, node, int(col))
        if start is None:
            continue
        rank = (0 if used else 1, remaining_room(used | geom.mask(start)), int(col))
        if best is None or rank < best[0]:
            best = (rank, int(col), start)
    return None if best is None else (best[1], best[2])


def build_allocation(cycle: Cycle, state: ClusterState, node: int,
                     choose_share: ShareChooser, lowest_whole: bool = False) -> Allocation | None:
    """The allocation of ``cycle``'s pod on ``node`` with the given share strategy.

    Whole GPUs are topology-aware unless ``lowest_whole`` (the reference simulator's rule:
    the lowest-index free GPUs).
    """
    gpus: dict[int, int] = {}
    mig: dict[int, int] | None = None
    if cycle.mig is not None:
        found = pick_mig(cycle, state, node)
        if found is None:
            return None
        col, start = found
        mig = {col: cycle.mig_by_model[int(state.gpu_model[node, col])].mask(start)}
    elif cycle.whole:
        free = usable_free(cycle, state, np.array([node]))[0]
        cols = np.flatnonzero(free == FULL_GPU_MILLI)
        if cols.size < cycle.whole:
            return None
        picked = ([int(c) for c in cols[:cycle.whole]] if lowest_whole
                  else pick_whole(state, node, cols, cycle.whole))
        gpus = dict.fromkeys(picked, FULL_GPU_MILLI)
    elif cycle.milli:
        free = usable_free(cycle, state, np.array([node]))[0]
        if free.max() < cycle.milli:
            return None
        gpus = {choose_share(cycle, state, node, free): cycle.milli}
    memory = cycle.pod.gpu_memory_mib if cycle.milli else 0
    return Allocation(node, gpus, cycle.cpu_milli, cycle.memory_bytes, mig, memory)


class GpuReserve:
    """GPU choice by configuration: ``share`` = bestfit | worstfit | random; ``whole`` =
    topology (one NVLink domain, then one NUMA node) | lowest (lowest-index free GPUs)."""

    name = "GpuReserve"

    def __init__(self, args: PluginArgs) -> None:
        strategy = str(args.get("share", "bestfit"))
        whole = str(args.get("whole", "topology"))
        if strategy not in SHARE_STRATEGIES:
            raise ValueError(f"GpuReserve: unknown share strategy {strategy!r}")
        if whole not in ("topology", "lowest"):
            raise ValueError(f"GpuReserve: unknown whole-GPU strategy {whole!r}")
        self._choose = SHARE_STRATEGIES[strategy]
        self._lowest = whole == "lowest"

    def reserve(self, cycle: Cycle, state: ClusterState, node: int) -> Allocation | None:
        return build_allocation(cycle, state, node, self._choose, self._lowest)
