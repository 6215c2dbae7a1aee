"""The FGD paper's protocol ("openb" experiments), run on the scheduler library.

For each seed: only GPU nodes; each GPU is 1000 milli; the pod list arrives shuffled,
followed by pods drawn at random with replacement until the arrived GPU request reaches
``tune`` x capacity (the reference simulator's workload tuning); pods arrive one by one,
never leave, are tried once and dropped if nothing fits. The metric is the share of
cluster GPU allocated when the arrived GPU request reaches a given % of capacity; the
headline is unallocated GPU % at arrived = 100 %.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gpucloud.scheduler.framework.cluster import Allocation, ClusterState, IntArray
from gpucloud.scheduler.plugins.fgd import FragModel, TypicalPods
from gpucloud.scheduler.scheduler import Scheduler
from gpucloud.scheduler.types import FULL_GPU_MILLI, NodeState, PodRequest

HEADLINE_PCT = 100

PlacementHook = Callable[[PodRequest, Allocation | None, ClusterState], None]


@dataclass(frozen=True)
class RunResult:
    """One policy, one seed. ``allocated_curve[x]``: allocated GPU % at arrived = x %."""

    policy: str
    seed: int
    allocated_curve: list[float]
    frag_pct_of_idle_at_100: float
    arrived: int
    placed: int
    seconds: float
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def unallocated_pct_at_100(self) -> float:
        return 100.0 - self.allocated_curve[HEADLINE_PCT]


def draw_arrivals(pods: Sequence[PodRequest], capacity_milli: int, tune: float,
                  seed: int) -> list[int]:
    """Indices of arriving pods, as the reference simulator's workload tuning does:

    the whole pod list in a random order (seeded), then, while the total GPU request is
    below ``tune`` x capacity, pods drawn at random with replacement appended; if the
    list alone exceeds the target, random pods are left out until it does not.
    """
    rng = np.random.default_rng(seed)
    request = np.array([p.gpu_request_milli for p in pods], np.int64)
    target = tune * capacity_milli
    order = [int(i) for i in rng.permutation(len(pods))]
    total = int(request.sum())
    if total > target:
        return _tune_down(order, request, total, target, rng)
    while total < target and len(pods):
        index = int(rng.integers(len(pods)))
        order.append(index)
        total += int(request[index])
    return order


def _tune_down(order: list[int], request: IntArray, total: int, target: float,
               rng: np.random.Generator) -> list[int]:
    """Drop random pods (keeping the order of the rest) until the total fits ``target``."""
    keep = np.ones(len(order), np.bool_)
    for position in rng.permutation(len(order)):
        if total <= target:
            break
        keep[position] = False
        total -= int(request[order[position]])
    return [index for index, kept in zip(order, keep, strict=True) if kept]


class _Curve:
    """Allocated % sampled each time the arrived request crosses a whole percent."""

    def __init__(self, capacity_milli: int, tune: float) -> None:
        self.capacity = capacity_milli
        self.points = int(round(tune * 100))
        self.values: list[float] = []

    def advance(self, arrived_after: int, allocated: int) -> list[int]:
        """Record points passed before ``arrived_after``; returns those just recorded."""
        done = []
        while (len(self.values) <= self.points
               and len(self.values) * self.capacity < arrived_after * 100):
            done.append(len(self.values))
            self.values.append(100.0 * allocated / self.capacity)
        return done

    def finish(self, allocated: int) -> list[float]:
        while len(self.values) <= self.points:
            self.values.append(100.0 * allocated / self.capacity)
        return self.values


def cluster_frag_pct(state: ClusterState, typical: TypicalPods) -> float:
    """Fragmented GPU (FGD measure) as % of idle GPU."""
    idle = float(state.free_milli.sum())
    if idle <= 0 or not typical.types:
        return 0.0
    frag = FragModel(typical, state).frag(np.arange(state.num_nodes)).sum()
    return 100.0 * float(frag) / idle


def run_openb(nodes: Sequence[NodeState], pods: Sequence[PodRequest], policy: str,
              seed: int, tune: float = 1.3, on_placement: PlacementHook | None = None,
              ) -> RunResult:
    """One simulated run; ``on_placement`` sees every arrival in order."""
    started = time.perf_counter()
    state = ClusterState.from_nodes(nodes)
    capacity = int(state.gpu_exists.sum()) * FULL_GPU_MILLI
    typical = TypicalPods.from_pods(pods)
    framework = Scheduler(policy, seed=seed).framework(state, pods)
    curve = _Curve(capacity, tune)
    allocated = arrived = placed = 0
    frag = 0.0
    order = draw_arrivals(pods, capacity, tune, seed)
    for index in order:
        pod = pods[index]
        arrived += pod.gpu_request_milli
        if HEADLINE_PCT in curve.advance(arrived, allocated):
            frag = cluster_frag_pct(state, typical)
        outcome = framework.schedule(pod)
        if outcome.allocation is not None:
            placed += 1
            allocated += pod.gpu_request_milli
        if on_placement is not None:
            on_placement(pod, outcome.allocation, state)
    if len(curve.values) <= HEADLINE_PCT:
        frag = cluster_frag_pct(state, typical)
    return RunResult(policy, seed, curve.finish(allocated), frag, len(order), placed,
                     time.perf_counter() - started)
