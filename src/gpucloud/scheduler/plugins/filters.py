"""Pre-filter and feasibility filters; every rejected node gets a stable reason text."""

from __future__ import annotations

import numpy as np

from gpucloud.scheduler.framework.cluster import BoolArray, ClusterState, IntArray
from gpucloud.scheduler.framework.plugin import Cycle, Rejections
from gpucloud.scheduler.framework.registry import PluginArgs
from gpucloud.scheduler.framework.status import Code, Status
from gpucloud.scheduler.mig import best_start, free_layout_start, known_profile, layout_starts
from gpucloud.scheduler.types import FULL_GPU_MILLI

NOT_READY = "node not ready"
CORDONED = "cordoned"
NOT_ENOUGH_GPUS = "not enough free GPUs"
TOO_FEW_GPUS = "too few GPUs on node"
NO_GPU_SHARE = "no GPU with enough free share"
NOT_ENOUGH_CPU = "not enough CPU"
NOT_ENOUGH_MEMORY = "not enough memory"
LABELS_MISMATCH = "node labels do not match"
#: A node whose MIG policy is ``off`` (``gpucloud node mig NODE --mode off``) takes no MIG
#: pods; the server sets this label from the policy (``services.mig``).
MIG_POLICY_LABEL = "gpucloud.io/mig-policy"
MIG_OFF = "MIG policy off on node"
MIG_MODE_OFF = "MIG mode off on its GPUs"


class RequestCheck:
    """Pre-filter: rejects malformed requests before any node is looked at."""

    name = "RequestCheck"

    def __init__(self, _args: PluginArgs) -> None:
        pass

    def pre_filter(self, cycle: Cycle, state: ClusterState) -> Status:
        del state
        pod = cycle.pod
        problem = _request_problem(pod.gpus, pod.gpu_milli, pod.mig_profile)
        if problem is None and min(pod.cpu_milli, pod.memory_bytes) < 0:
            problem = "CPU and memory requests must not be negative"
        if problem:
            return Status(Code.ERROR, (problem,))
        return Status(Code.SUCCESS)


def _request_problem(gpus: int, gpu_milli: int, mig_profile: str | None) -> str | None:
    if gpus < 0:
        return "gpus must not be negative"
    if gpus == 0 and not 0 <= gpu_milli < FULL_GPU_MILLI:
        return "gpu_milli must be 1..999 (ask for whole GPUs with gpus)"
    if mig_profile is not None and (gpus or gpu_milli):
        return "a MIG profile cannot be combined with gpus or gpu_milli"
    if mig_profile is not None and not known_profile(mig_profile):
        return f"unknown MIG profile {mig_profile}"
    return None


class NodeCondition:
    """Rejects nodes that are not ready or cordoned."""

    name = "NodeCondition"
    node_local = True  # see scheduler/framework/tables.py

    def __init__(self, _args: PluginArgs) -> None:
        pass

    def filter(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> Rejections:
        del cycle
        return [(NOT_READY, ~state.ready[nodes]), (CORDONED, state.cordoned[nodes])]


class NodeSelector:
    """Rejects nodes whose labels do not carry every ``key=value`` the pod selects."""

    name = "NodeSelector"
    node_local = True  # see scheduler/framework/tables.py

    def __init__(self, _args: PluginArgs) -> None:
        pass

    def filter(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> Rejections:
        selector = cycle.pod.node_selector
        if not selector:
            return []
        items = selector.items()
        labels = state.labels
        bad = np.array([not all(labels[i].get(k) == v for k, v in items) for i in nodes],
                       np.bool_)
        return [(LABELS_MISMATCH, bad)]


def volume_on(node: str) -> str:
    """The rejection reason of every node but the one holding the pod's volume."""
    return f"its volume is on node {node}"


class RequiredNode:
    """Rejects every node but ``PodRequest.required_node``: a pod whose volume disk lives on
    one node restarts there (its own reason, so `pod why` can say where)."""

    name = "RequiredNode"
    node_local = True  # see scheduler/framework/tables.py

    def __init__(self, _args: PluginArgs) -> None:
        pass

    def filter(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> Rejections:
        required = cycle.pod.required_node
        if required is None:
            return []
        names = state.names
        bad = np.array([names[i] != required for i in nodes], np.bool_)
        return [(volume_on(required), bad)]


def preempted_on(node: str) -> str:
    """The rejection reason of the node a pod was just preempted from."""
    return f"just preempted from node {node}"


class AvoidNode:
    """Rejects ``PodRequest.avoid_nodes``: a preempted pod is not placed straight back on
    the node that preempted it."""

    name = "AvoidNode"
    node_local = True  # see scheduler/framework/tables.py

    def __init__(self, _args: PluginArgs) -> None:
        pass

    def filter(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> Rejections:
        avoided = cycle.pod.avoid_nodes
        if not avoided:
            return []
        names = state.names
        return [(preempted_on(node), np.array([names[i] == node for i in nodes], np.bool_))
                for node in avoided]


class CpuMemoryFit:
    """Rejects nodes without the free CPU or memory the pod requests."""

    name = "CpuMemoryFit"
    node_local = True  # see scheduler/framework/tables.py

    def __init__(self, _args: PluginArgs) -> None:
        pass

    def filter(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> Rejections:
        out: Rejections = []
        if cycle.cpu_milli:
            out.append((NOT_ENOUGH_CPU, state.cpu_free[nodes] < cycle.cpu_milli))
        if cycle.memory_bytes:
            out.append((NOT_ENOUGH_MEMORY, state.mem_free[nodes] < cycle.memory_bytes))
        return out


class GpuModel:
    """Rejects nodes with no GPU of the requested model / memory / MIG profile at all."""

    name = "GpuModel"
    node_local = True  # see scheduler/framework/tables.py

    def __init__(self, _args: PluginArgs) -> None:
        pass

    def filter(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> Rejections:
        pod = cycle.pod
        if not cycle.wants_gpu:
            return []
        if not (pod.gpu_model or pod.min_gpu_memory_mib or pod.mig_profile):
            return [(TOO_FEW_GPUS, np.asarray(state.gpu_count[nodes] <= 0, np.bool_))]
        none = ~cycle.eligible_nodes[nodes]
        if pod.mig_profile:
            labels = state.labels
            off = np.array([labels[i].get(MIG_POLICY_LABEL) == "off" for i in nodes], np.bool_)
            offered = state.mig_capable[nodes] & np.isin(state.gpu_model[nodes],
                                                         list(cycle.mig_by_model))
            no_model = np.asarray(~offered.any(axis=1), np.bool_)
            return [(MIG_OFF, off), (_model_reason(cycle), no_model),
                    (MIG_MODE_OFF, none & ~no_model)]
        return [(_model_reason(cycle), none)]


def _model_reason(cycle: Cycle) -> str:
    pod = cycle.pod
    if pod.mig_profile:
        return f"no GPU offering MIG profile {pod.mig_profile}"
    if pod.gpu_model:
        return f"no GPU of model {pod.gpu_model}"
    return f"no GPU with at least {pod.min_gpu_memory_mib} MiB"


class GpuFit:
    """Rejects nodes without enough free capacity on GPUs the pod may use."""

    name = "GpuFit"
    node_local = True  # see scheduler/framework/tables.py

    def __init__(self, _args: PluginArgs) -> None:
        pass

    def filter(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> Rejections:
        if cycle.mig is not None:
            reason = f"no free MIG slot for {cycle.pod.mig_profile}"
            return [(reason, ~mig_fit(cycle, state, nodes))]
        if cycle.whole:
            total = cycle.eligible_count[nodes]
            free = free_whole(cycle, state, nodes)
            return [(TOO_FEW_GPUS, total < cycle.whole),
                    (NOT_ENOUGH_GPUS, free < cycle.whole)]
        if cycle.milli:
            return [(NO_GPU_SHARE, max_share(cycle, state, nodes) < cycle.milli)]
        return []


def constrained(cycle: Cycle) -> bool:
    pod = cycle.pod
    return bool(pod.gpu_model or pod.min_gpu_memory_mib or pod.mig_profile
                or (cycle.milli and pod.gpu_memory_mib))


def usable_free(cycle: Cycle, state: ClusterState, nodes: IntArray | None = None) -> IntArray:
    """Free milli per GPU that this pod may use (0 on GPUs it may not use, and for a share
    with a memory limit on GPUs with less memory left than it asks)."""
    sel: IntArray | slice = slice(None) if nodes is None else nodes
    free = state.gpu_free[sel]
    if not constrained(cycle):
        return free
    ok = cycle.eligible[sel]
    if cycle.milli and cycle.pod.gpu_memory_mib:
        ok = ok & (state.gpu_mem_free[sel] >= cycle.pod.gpu_memory_mib)
    return np.where(ok, free, 0)


def free_whole(cycle: Cycle, state: ClusterState, nodes: IntArray) -> IntArray:
    """Number of fully free usable GPUs on each of ``nodes``."""
    if not constrained(cycle):
        return state.full_free[nodes]
    free = usable_free(cycle, state, nodes)
    return np.asarray((free == FULL_GPU_MILLI).sum(axis=1), np.int64)


def max_share(cycle: Cycle, state: ClusterState, nodes: IntArray) -> IntArray:
    """Largest free share on one usable GPU of each of ``nodes``."""
    if not constrained(cycle):
        return state.max_free[nodes]
    return np.asarray(usable_free(cycle, state, nodes).max(axis=1), np.int64)


def mig_fit(cycle: Cycle, state: ClusterState, nodes: IntArray) -> BoolArray:
    """Nodes with a usable GPU where an instance of the pod's MIG profile has a start slot.

    A GPU is usable for MIG if it already runs MIG instances or is entirely free (a GPU
    with time-sliced shares cannot switch to MIG mode).
    """
    assert cycle.mig is not None
    used = state.mig_used[nodes]
    layout = state.mig_layout_id[nodes]
    mode_ok = cycle.eligible[nodes] & ((used != 0) | (state.gpu_free[nodes] == FULL_GPU_MILLI)
                                       | (layout != 0) | state.mig_on[nodes])
    slot_ok = np.zeros(used.shape, np.bool_)
    gpu_model = state.gpu_model[nodes]
    for model_id, geom in cycle.mig_by_model.items():
        on_model = gpu_model == model_id
        for mask in geom.masks:
            slot_ok |= on_model & ((used & mask) == 0)
    slot_ok &= layout == 0
    for row, col in zip(*np.nonzero((layout != 0) & cycle.eligible[nodes]), strict=True):
        slot_ok[row, col] = mig_start(cycle, state, int(nodes[row]), int(col)) is not None
    return np.asarray((mode_ok & slot_ok).any(axis=1), np.bool_)


def mig_start(cycle: Cycle, state: ClusterState, node: int, col: int) -> int | None:
    """Where an instance of the pod's profile would start on one GPU: on a fixed layout a
    free existing instance of that profile, else the start that keeps the most room."""
    geom = cycle.mig_by_model.get(int(state.gpu_model[node, col]))
    if geom is None or cycle.pod.mig_profile is None:
        return None
    used = int(state.mig_used[node, col])
    layout = int(state.mig_layout_id[node, col])
    if layout:
        starts = layout_starts(state.mig_layouts[layout - 1], cycle.pod.mig_profile)
        return free_layout_start(geom, starts, used)
    return best_start(geom, used)
