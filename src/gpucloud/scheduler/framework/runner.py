"""The scheduling cycle: pre-filter → filter → score → reserve → commit, for one pod.

``Framework`` owns a ``ClusterState`` and places pods one at a time; each placement is
committed before the next pod is considered, so later pods see earlier ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpucloud.core.gpu_models import canonical_name
from gpucloud.scheduler.framework.cluster import (
    Allocation,
    BoolArray,
    ClusterState,
    FloatArray,
    IntArray,
)
from gpucloud.scheduler.framework.plugin import CommitListener, Cycle
from gpucloud.scheduler.framework.registry import Profile
from gpucloud.scheduler.framework.status import Code, Status
from gpucloud.scheduler.framework.tables import ShapeTable, ShapeTables
from gpucloud.scheduler.mig import MigGeometry, geometry, models_with_profile
from gpucloud.scheduler.types import PodRequest


@dataclass(frozen=True)
class Outcome:
    """Result of one cycle: an allocation (committed) or a status with reasons per node."""

    allocation: Allocation | None
    status: Status
    reasons: dict[str, int]


def model_alternatives(spec: str | None) -> tuple[str, ...]:
    """Canonical names of the GPU models a pod accepts (``A|B`` lists alternatives)."""
    if not spec:
        return ()
    return tuple(canonical_name(part) for part in spec.split("|") if part.strip())


@dataclass(frozen=True)
class Eligibility:
    """The GPUs a pod may use ([N, G]), how many per node, and which nodes have any."""

    mask: BoolArray
    count: IntArray
    nodes: BoolArray


class EligibilityCache:
    """Masks of the GPUs a pod may use, cached by constraint (they depend on static data)."""

    def __init__(self, state: ClusterState) -> None:
        self._state = state
        self._cache: dict[tuple[str | None, int | None, str | None], Eligibility] = {}

    def get(self, pod: PodRequest) -> Eligibility:
        key = (pod.gpu_model, pod.min_gpu_memory_mib, pod.mig_profile)
        found = self._cache.get(key)
        if found is None:
            mask = self._compute(pod)
            count = np.asarray(mask.sum(axis=1), np.int64)
            found = Eligibility(mask, count, count > 0)
            self._cache[key] = found
        return found

    def _compute(self, pod: PodRequest) -> BoolArray:
        state = self._state
        mask = state.gpu_exists.copy()
        models = set(model_alternatives(pod.gpu_model))
        if pod.mig_profile:
            mig_models = set(models_with_profile(pod.mig_profile))
            models = models & mig_models if models else mig_models
            mask &= state.mig_capable & state.mig_mode  # never a GPU whose MIG mode is off
        if models or pod.mig_profile:
            ids = [i for i, name in enumerate(state.model_names) if name in models]
            mask &= np.isin(state.gpu_model, ids)
        if pod.min_gpu_memory_mib:
            mask &= state.gpu_mem_mib >= pod.min_gpu_memory_mib
        return mask


class Framework:
    """Runs a profile's plugins against a cluster state it owns and updates."""

    def __init__(self, profile: Profile, state: ClusterState, seed: int = 0,
                 shape_tables: bool = True) -> None:
        self.profile = profile
        self.state = state
        self.rng = np.random.default_rng(seed)
        # Tie-break order of "rank": a random but fixed priority of the nodes, drawn once
        # per seed (the reference simulator prefixes node names with a seeded random
        # permutation and its scheduler takes the lexicographically smallest tied node).
        self.node_rank = self.rng.permutation(state.num_nodes)
        self._eligibility = EligibilityCache(state)
        self._mig_cache: dict[str, dict[int, MigGeometry]] = {}
        self._all_nodes = np.arange(state.num_nodes, dtype=np.int64)
        plugins = [p for p, _ in profile.scores] + [profile.reserve]
        self._listeners = [p for p in plugins if isinstance(p, CommitListener)]
        #: Per pod shape, every node's filter verdict and raw scores (``tables``).
        #: ``shape_tables=False`` runs every plugin on every pod's candidates (the plain
        #: path: the tables must decide as it does).
        self._tables = ShapeTables(profile, state, enabled=shape_tables)

    def _mig_shapes(self, profile: str | None) -> dict[int, MigGeometry]:
        """The profile's geometry on each GPU model of the cluster that offers it."""
        if not profile:
            return {}
        found = self._mig_cache.get(profile)
        if found is not None:
            return found
        shapes: dict[int, MigGeometry] = {}
        for model in models_with_profile(profile):
            model_id = self.state.known_model_id(model)
            geom = geometry(model, profile)
            if model_id is not None and geom is not None:
                shapes[model_id] = geom
        self._mig_cache[profile] = shapes
        return shapes

    def new_cycle(self, pod: PodRequest) -> Cycle:
        geom = None
        if pod.mig_profile:
            models = models_with_profile(pod.mig_profile)
            geom = geometry(models[0], pod.mig_profile) if models else None
        eligible = self._eligibility.get(pod)
        return Cycle(
            pod=pod,
            whole=pod.gpus,
            milli=pod.gpu_milli if pod.gpus == 0 else 0,
            cpu_milli=pod.cpu_milli,
            memory_bytes=pod.memory_bytes,
            eligible=eligible.mask,
            eligible_count=eligible.count,
            eligible_nodes=eligible.nodes,
            rng=self.rng,
            mig=geom,
            mig_by_model=self._mig_shapes(pod.mig_profile),
            model_label=pod.gpu_model or "",
        )

    def schedule(self, pod: PodRequest) -> Outcome:
        """Place one pod: commit and return its allocation, or explain why it cannot go."""
        cycle = self.new_cycle(pod)
        for plugin in self.profile.pre_filters:
            status = plugin.pre_filter(cycle, self.state)
            if not status.ok:
                return Outcome(None, status, {})
        table = self._tables.table(cycle)
        nodes = self._candidates(cycle, table)
        if nodes.size == 0:
            return self._unschedulable(cycle)
        allocation = self._choose(cycle, nodes, table)
        if allocation is None:
            return Outcome(None, Status(Code.UNSCHEDULABLE, ("no GPU arrangement fits",)), {})
        self.state.commit(allocation)
        for listener in self._listeners:
            listener.committed(cycle, self.state, allocation)
        return Outcome(allocation, Status(Code.SUCCESS), {})

    def _candidates(self, cycle: Cycle, table: ShapeTable | None = None) -> IntArray:
        """The feasible nodes to score.

        On a cluster larger than the profile's ``sample_threshold``, a random sample of
        ``sample_size`` nodes is checked first (Nomad-style): if at least a quarter of it is
        feasible, those are scored, so the cost of a placement does not grow with the
        cluster. Otherwise (capacity is scarce) every node is checked and a sample of the
        feasible ones is scored.
        """
        sample = self._presample()
        if sample is not None:
            feasible = sample[self._feasible(cycle, sample, table)]
            if feasible.size * 4 >= sample.size:
                return feasible
        feasible = self._all_nodes[self._feasible(cycle, self._all_nodes, table)]
        return self._sample(feasible)

    def _presample(self) -> IntArray | None:
        limit = self.profile.sample_size
        threshold = self.profile.sample_threshold or limit
        if limit is None or threshold is None or self.state.num_nodes <= max(threshold, limit):
            return None
        return _dedupe(self.rng.integers(self.state.num_nodes, size=limit))

    def _feasible(self, cycle: Cycle, nodes: IntArray,
                  table: ShapeTable | None = None) -> BoolArray:
        """Mask over ``nodes`` of those that pass every filter (read from the shape's
        table, brought up to date for them, when there is one)."""
        if table is not None:
            self._tables.current(cycle, table, nodes)
            return table.ok[nodes]
        ok = np.ones(nodes.size, np.bool_)
        for plugin in self.profile.filters:
            for _reason, rejected in plugin.filter(cycle, self.state, nodes):
                ok &= ~rejected
        return ok

    def _unschedulable(self, cycle: Cycle) -> Outcome:
        """Count, per reason, the nodes whose first failing filter gave that reason."""
        remaining = np.ones(self.state.num_nodes, np.bool_)
        reasons: dict[str, int] = {}
        for plugin in self.profile.filters:
            for reason, rejected in plugin.filter(cycle, self.state, self._all_nodes):
                hit = remaining & rejected
                count = int(hit.sum())
                if count:
                    reasons[reason] = reasons.get(reason, 0) + count
                    remaining &= ~hit
        code = Code.UNSCHEDULABLE
        if self.state.num_nodes and all(_permanent(r) for r in reasons):
            code = Code.UNSCHEDULABLE_AND_UNRESOLVABLE
        return Outcome(None, Status(code, tuple(reasons)), reasons)

    def _choose(self, cycle: Cycle, nodes: IntArray,
                table: ShapeTable | None = None) -> Allocation | None:
        scores = self._score(cycle, nodes, table)
        first = self._best(scores, nodes)
        allocation = self.profile.reserve.reserve(cycle, self.state, int(nodes[first]))
        if allocation is not None:
            return allocation
        # Reserve can still fail on a node (e.g. no MIG start slot); try the next best.
        for position in self._ranking(scores, first)[1:8]:
            allocation = self.profile.reserve.reserve(cycle, self.state, int(nodes[position]))
            if allocation is not None:
                return allocation
        return None

    def _sample(self, nodes: IntArray) -> IntArray:
        limit = self.profile.sample_size
        threshold = self.profile.sample_threshold or limit
        if limit is None or threshold is None or nodes.size <= max(threshold, limit):
            return nodes
        picks = _dedupe(self.rng.integers(nodes.size, size=limit))
        return np.asarray(nodes[picks], np.int64)

    def _score(self, cycle: Cycle, nodes: IntArray,
               table: ShapeTable | None = None) -> FloatArray:
        scorers = self.profile.scores
        if table is not None:
            if len(scorers) == 1:
                return scorers[0][1] * table.raw[0][nodes]
            # A plugin constant on every node would add zero once normalised: skipped.
            raws = [raw[nodes] for raw, same in zip(table.raw, table.constant, strict=True)
                    if same is None]
            weights = [w for (_, w), same in zip(scorers, table.constant, strict=True)
                       if same is None]
        else:
            raws = [plugin.score(cycle, self.state, nodes) for plugin, _ in scorers]
            weights = [w for _, w in scorers]
            if len(scorers) == 1:
                return weights[0] * raws[0]
        total = np.zeros(nodes.size, np.float64)
        for raw, weight in zip(raws, weights, strict=True):
            total += weight * _normalize(raw)
        return total

    def _best(self, scores: FloatArray, nodes: IntArray) -> int:
        """Position of the best score; ties broken by the profile's rule."""
        best = scores.max()
        top = np.flatnonzero(scores >= best - 1e-9)
        first = int(top[0])
        if top.size > 1 and self.profile.tie_break == "random":
            first = int(top[self.rng.integers(top.size)])
        elif top.size > 1 and self.profile.tie_break == "rank":
            first = int(top[np.argmin(self.node_rank[nodes[top]])])
        return first

    @staticmethod
    def _ranking(scores: FloatArray, first: int) -> IntArray:
        """Positions best first, starting with ``first`` (``_best``'s pick)."""
        rest = np.argsort(-scores, kind="stable")
        return np.concatenate(([first], rest[rest != first]))


_PERMANENT_PREFIXES = ("no GPU of model", "no GPU with at least", "no GPU offering MIG",
                       "node labels do not match", "too few GPUs on node")


def _permanent(reason: str) -> bool:
    """Reasons that capacity freeing up elsewhere cannot cure."""
    return reason.startswith(_PERMANENT_PREFIXES)


def _dedupe(values: IntArray) -> IntArray:
    """Sorted distinct values (cheaper than ``np.unique`` on a few hundred integers)."""
    values = np.sort(values)
    keep = np.ones(values.size, np.bool_)
    keep[1:] = values[1:] != values[:-1]
    return np.asarray(values[keep], np.int64)


def _normalize(raw: FloatArray) -> FloatArray:
    """Min-max scale to 0..100 so that weights compare plugins on one footing."""
    low, high = float(raw.min()), float(raw.max())
    if high - low < 1e-12:
        return np.zeros_like(raw)
    return (raw - low) * (100.0 / (high - low))
