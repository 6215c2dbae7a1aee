"""Fragmentation Gradient Descent (Weng et al., ATC '23) and the workload model it needs.

The *fragmentation* of a node, measured against a target workload (the "typical pods" and
their popularity), is the expected amount of its free GPU capacity that a random typical
pod could not use: for each typical pod type, all free GPU if the pod cannot run on the
node at all, otherwise the free capacity of the GPUs too small for it. FGD places a pod
where (and on the GPU where) this fragmentation grows least.

Scores are a pure function of (node state, pod shape), so they are cached per shape and
recomputed only for nodes changed since the shape was last seen.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpucloud.scheduler.framework.cluster import (
    Allocation,
    BoolArray,
    ClusterState,
    FloatArray,
    IntArray,
)
from gpucloud.scheduler.framework.plugin import Cycle
from gpucloud.scheduler.framework.registry import PluginArgs
from gpucloud.scheduler.plugins.reserve import build_allocation, share_best_fit
from gpucloud.scheduler.types import FULL_GPU_MILLI, PodRequest

MAX_SCORE = 100


@dataclass(frozen=True)
class TypicalConfig:
    """How the target workload is summarised (the reference simulator's
    ``typicalPodsConfig``): pod types are taken, most popular first, ``step`` at a time
    until they cover ``threshold`` of the pods; CPU-only pods count when ``cpu_pods``.

    The defaults are those of the published experiments (95 %, step 1, CPU pods in).
    """

    threshold: float = 0.95
    step: int = 1
    cpu_pods: bool = True

    @classmethod
    def from_args(cls, args: PluginArgs) -> TypicalConfig:
        base = cls()
        return cls(float(args.get("typical_threshold", base.threshold)),
                   int(args.get("typical_step", base.step)),
                   bool(args.get("typical_cpu_pods", base.cpu_pods)))


@dataclass(frozen=True)
class PodType:
    """A pod shape of the target workload: CPU, milli per GPU, GPU count, GPU model spec."""

    cpu_milli: int
    gpu_milli: int
    num_gpus: int
    model: str


@dataclass(frozen=True)
class TypicalPods:
    """The target workload as (pod type, probability), most popular first."""

    types: tuple[PodType, ...]
    weights: tuple[float, ...]

    @classmethod
    def from_pods(cls, pods: Sequence[PodRequest],
                  config: TypicalConfig | None = None) -> TypicalPods:
        """The most popular pod types covering ``config.threshold`` of the pods,
        renormalised (CPU-only pods included when ``config.cpu_pods``)."""
        config = config or TypicalConfig()
        counts = Counter(pod_type(p) for p in pods
                         if config.cpu_pods or p.gpus or p.gpu_milli)
        if not counts:
            return cls((), ())
        ordered = sorted(counts.items(), key=lambda kv: (kv[1], _order_key(kv[0])),
                         reverse=True)
        total = sum(counts.values())
        chosen = _popular_prefix([n for _, n in ordered], total, config)
        kept = ordered[:chosen]
        covered = sum(n for _, n in kept)
        return cls(tuple(t for t, _ in kept), tuple(n / covered for _, n in kept))


def _order_key(t: PodType) -> tuple[int, int, int, str]:
    return (t.cpu_milli, t.gpu_milli, t.num_gpus, t.model)


def _popular_prefix(counts: list[int], total: int, config: TypicalConfig) -> int:
    """How many of the (sorted) types to keep: ``step`` at a time until covered."""
    taken, cumulative = 0, 0
    while cumulative < config.threshold * total and taken < len(counts):
        step_end = min(taken + max(config.step, 1), len(counts))
        cumulative += sum(counts[taken:step_end])
        taken = step_end
    return taken


def pod_type(pod: PodRequest) -> PodType:
    if pod.gpus:
        return PodType(pod.cpu_milli, FULL_GPU_MILLI, pod.gpus, pod.gpu_model or "")
    return PodType(pod.cpu_milli, pod.gpu_milli, 1 if pod.gpu_milli else 0, pod.gpu_model or "")


class FragModel:
    """Vectorised fragmentation of nodes against typical pods, bound to one cluster state."""

    def __init__(self, typical: TypicalPods, state: ClusterState) -> None:
        self.state = state
        types = typical.types
        self.p = np.array(typical.weights, np.float64)
        self.t_milli = np.array([t.gpu_milli for t in types], np.int64)
        self.t_num = np.array([t.num_gpus for t in types], np.int64)
        self.t_cpu = np.array([t.cpu_milli for t in types], np.int64)
        self.cpu_only = self.t_num == 0
        self.access = self._access(types, state)  # [N, T]

    @staticmethod
    def _access(types: Sequence[PodType], state: ClusterState) -> BoolArray:
        names = [state.model_names[m] if m >= 0 else "" for m in state.node_model]
        out = np.ones((len(names), len(types)), np.bool_)
        for j, t in enumerate(types):
            if t.model:
                allowed = {m.strip() for m in t.model.split("|")}
                out[:, j] = [name in allowed for name in names]
        return out

    def parts(self, nodes: IntArray) -> tuple[IntArray, IntArray, IntArray]:
        """Per node and type: GPUs big enough, free milli on GPUs too small; free total."""
        left = self.state.gpu_free[nodes]
        big = left[:, None, :] >= self.t_milli[None, :, None]
        count = big.sum(axis=2)
        small = np.where(big, 0, left[:, None, :]).sum(axis=2)
        return count, small, left.sum(axis=1)

    def combine(self, nodes: IntArray, cpu: IntArray, count: IntArray, small: IntArray,
                total: IntArray) -> FloatArray:
        """Expected fragmentation from the parts; ``nodes`` indexes the access table.

        Arrays may carry an extra GPU-choice axis between node and type. A CPU-only
        type uses no GPU, so for it all free GPU counts as fragment (as in the paper).
        """
        access = self.access[nodes]
        if count.ndim == 3:
            access = access[:, None, :]
        fits = (access & (count >= self.t_num) & (cpu[..., None] >= self.t_cpu)
                & ~self.cpu_only)
        frag = np.where(fits, small, total[..., None])
        return frag @ self.p

    def frag(self, nodes: IntArray) -> FloatArray:
        count, small, total = self.parts(nodes)
        return self.combine(nodes, self.state.cpu_free[nodes], count, small, total)


def frag_score(delta: FloatArray) -> IntArray:
    """The paper's score: sigmoid of the fragmentation decrease (in GPUs), as int 0..100."""
    return (MAX_SCORE / (1.0 + np.exp(-delta / 1000.0))).astype(np.int64)


def stranding(free_gpu: IntArray, cpu: IntArray, cpu_per_gpu: float) -> FloatArray:
    """Free GPU milli that lacks the CPU to be used (at the workload's CPU per GPU)."""
    needed = free_gpu * (cpu_per_gpu / FULL_GPU_MILLI)
    short = np.clip(1.0 - cpu / np.maximum(needed, 1.0), 0.0, 1.0)
    return np.asarray(free_gpu * short, np.float64)


@dataclass
class _ScoreCache:
    """Scores of one pod shape: per node (valid while ``seen`` equals the node's version)
    and per class of identical, never-changed nodes."""

    score: FloatArray
    gpu: IntArray
    seen: IntArray
    class_score: FloatArray
    class_gpu: IntArray
    class_done: BoolArray

    @classmethod
    def empty(cls, nodes: int, classes: int) -> _ScoreCache:
        return cls(np.zeros(nodes, np.float64), np.full(nodes, -1, np.int64),
                   np.full(nodes, -1, np.int64), np.zeros(classes, np.float64),
                   np.full(classes, -1, np.int64), np.zeros(classes, np.bool_))


class FgdEvaluator:
    """Best FGD score and GPU per node for a pod shape, cached until the node changes.

    ``refined`` selects gpucloud's variant: the raw fragmentation decrease (no sigmoid,
    no integer rounding, so near-ties are decided by the real difference) minus the growth
    of CPU-stranded GPU capacity (GPUs left on nodes without the CPU to use them).
    """

    def __init__(self, model: FragModel, refined: bool = False,
                 cpu_per_gpu: float = 0.0) -> None:
        self.model = model
        self.refined = refined
        self.cpu_per_gpu = cpu_per_gpu
        self._cache: dict[tuple[int, int, int, str | None, int | None], _ScoreCache] = {}

    def _score(self, delta: FloatArray, total: IntArray, cpu: IntArray, total2: IntArray,
               cpu2: IntArray) -> FloatArray:
        if not self.refined:
            return np.asarray(frag_score(delta), np.float64)
        penalty = (stranding(total2, cpu2, self.cpu_per_gpu)
                   - stranding(total, cpu, self.cpu_per_gpu))
        return np.asarray(delta - penalty, np.float64)

    def evaluate(self, cycle: Cycle, nodes: IntArray) -> tuple[FloatArray, IntArray]:
        """(score, GPU column or -1) for each node of ``nodes``."""
        key = (cycle.cpu_milli, cycle.milli, cycle.whole, cycle.pod.gpu_model,
               cycle.pod.min_gpu_memory_mib)
        state = self.model.state
        entry = self._cache.get(key)
        if entry is None:
            entry = _ScoreCache.empty(state.num_nodes, state.num_classes)
            self._cache[key] = entry
        stale = nodes[entry.seen[nodes] != state.node_version[nodes]]
        if stale.size:
            untouched = state.node_version[stale] == 0
            self._fill_classes(cycle, entry, stale[untouched])
            self._fill_nodes(cycle, entry, stale[~untouched])
        return entry.score[nodes], entry.gpu[nodes]

    def _fill_nodes(self, cycle: Cycle, entry: _ScoreCache, nodes: IntArray) -> None:
        if nodes.size:
            state = self.model.state
            s, g = self._compute(cycle, nodes)
            entry.score[nodes], entry.gpu[nodes] = s, g
            entry.seen[nodes] = state.node_version[nodes]

    def _fill_classes(self, cycle: Cycle, entry: _ScoreCache, nodes: IntArray) -> None:
        """Nodes still as loaded: computed once per class of identical nodes."""
        if not nodes.size:
            return
        state = self.model.state
        classes = state.node_class[nodes]
        todo = ~entry.class_done[classes]
        if todo.any():
            missing, first = np.unique(classes[todo], return_index=True)
            s, g = self._compute(cycle, nodes[todo][first])
            entry.class_score[missing], entry.class_gpu[missing] = s, g
            entry.class_done[missing] = True
        entry.score[nodes], entry.gpu[nodes] = entry.class_score[classes], entry.class_gpu[classes]
        entry.seen[nodes] = 0

    def _compute(self, cycle: Cycle, nodes: IntArray) -> tuple[FloatArray, IntArray]:
        if cycle.milli:
            return self._compute_share(cycle, nodes)
        model, state = self.model, self.model.state
        count, small, total = model.parts(nodes)
        before = model.combine(nodes, state.cpu_free[nodes], count, small, total)
        cpu = state.cpu_free[nodes] - cycle.cpu_milli
        total2 = total - cycle.whole * FULL_GPU_MILLI
        after = model.combine(nodes, cpu, count - cycle.whole, small, total2)
        score = self._score(before - after, total, state.cpu_free[nodes], total2, cpu)
        return score, np.full(nodes.size, -1, np.int64)

    def _compute_share(self, cycle: Cycle, nodes: IntArray) -> tuple[FloatArray, IntArray]:
        """Try the share on every GPU that fits; keep the best (lowest index on ties)."""
        model, state = self.model, self.model.state
        m = cycle.milli
        count, small, total = model.parts(nodes)
        before = model.combine(nodes, state.cpu_free[nodes], count, small, total)
        left = state.gpu_free[nodes]
        new = left - m
        t_milli = model.t_milli[None, None, :]
        was_big = left[:, :, None] >= t_milli
        now_big = new[:, :, None] >= t_milli
        count2 = count[:, None, :] - was_big + now_big
        small2 = (small[:, None, :] - np.where(was_big, 0, left[:, :, None])
                  + np.where(now_big, 0, new[:, :, None]))
        cpu = np.broadcast_to((state.cpu_free[nodes] - cycle.cpu_milli)[:, None], left.shape)
        total2 = np.broadcast_to((total - m)[:, None], left.shape)
        after = model.combine(nodes, cpu, count2, small2, total2)
        cpu0 = state.cpu_free[nodes][:, None]
        scores = self._score(before[:, None] - after, total[:, None], cpu0, total2, cpu)
        usable = cycle.eligible[nodes] & (left >= m)
        scores = np.where(usable, scores, -np.inf)
        best = scores.argmax(axis=1)
        return scores[np.arange(nodes.size), best], best


def fgd_evaluator(state: ClusterState, typical: TypicalPods, refined: bool = False,
                  cpu_per_gpu: float = 0.0) -> FgdEvaluator:
    """The evaluator bound to ``state`` (one per state, workload and variant)."""
    key = f"fgd:{id(typical)}:{refined}"
    found = state.extensions.get(key)
    if not isinstance(found, FgdEvaluator):
        found = FgdEvaluator(FragModel(typical, state), refined, cpu_per_gpu)
        state.extensions[key] = found
    return found


_TYPICAL_CACHE: dict[tuple[int, TypicalConfig], tuple[object, TypicalPods, float]] = {}


def typical_from_args(args: PluginArgs) -> tuple[TypicalPods, float]:
    """Typical pods and CPU milli per GPU of the ``workload`` argument (memoised per
    workload and typical-pod configuration, so that score and reserve share them)."""
    workload = args.get("workload") or ()
    config = TypicalConfig.from_args(args)
    key = (id(workload), config)
    found = _TYPICAL_CACHE.get(key)
    if found is not None and found[0] is workload:
        return found[1], found[2]
    pods = list(workload)
    typical = TypicalPods.from_pods(pods, config)
    gpu = sum(p.gpu_request_milli for p in pods)
    cpu = sum(p.cpu_milli for p in pods if p.gpu_request_milli)
    ratio = FULL_GPU_MILLI * cpu / gpu if gpu else 0.0
    if any(k[0] != id(workload) or v[0] is not workload for k, v in _TYPICAL_CACHE.items()):
        _TYPICAL_CACHE.clear()
    _TYPICAL_CACHE[key] = (workload, typical, ratio)
    return typical, ratio


class FgdScore:
    """Score = sigmoid(fragmentation decrease) for the best GPU choice on the node.

    With ``refined: true``: the raw decrease minus the growth of CPU-stranded GPU.
    """

    name = "FGD"
    node_local = True  # see scheduler/framework/tables.py

    def __init__(self, args: PluginArgs) -> None:
        self.typical, self.cpu_per_gpu = typical_from_args(args)
        self.refined = bool(args.get("refined", False))

    def evaluator(self, state: ClusterState) -> FgdEvaluator:
        return fgd_evaluator(state, self.typical, self.refined, self.cpu_per_gpu)

    def score(self, cycle: Cycle, state: ClusterState, nodes: IntArray) -> FloatArray:
        scores, _ = self.evaluator(state).evaluate(cycle, nodes)
        return scores


class FgdReserve:
    """GPU choice of FGD: the share goes to the GPU that fragments least; whole GPUs to the
    lowest-index free ones (as the reference simulator does)."""

    name = "FgdReserve"

    def __init__(self, args: PluginArgs) -> None:
        self.typical, self.cpu_per_gpu = typical_from_args(args)
        self.refined = bool(args.get("refined", False))
        self.whole = str(args.get("whole", "lowest"))

    def reserve(self, cycle: Cycle, state: ClusterState, node: int) -> Allocation | None:
        if cycle.mig is not None or not cycle.milli or cycle.pod.gpu_memory_mib:
            # A share with a memory limit: best fit among the GPUs with that memory left.
            return build_allocation(cycle, state, node, share_best_fit,
                                    lowest_whole=self.whole == "lowest")
        evaluator = fgd_evaluator(state, self.typical, self.refined, self.cpu_per_gpu)
        _, gpu = evaluator.evaluate(cycle, np.array([node]))
        col = int(gpu[0])
        if col < 0 or state.gpu_free[node, col] < cycle.milli:
            return None
        return Allocation(node, {col: cycle.milli}, cycle.cpu_milli, cycle.memory_bytes)
