"""Bounded scoring on large clusters: a random sample is checked first, every node only
when capacity is scarce (so a lone fitting node is still found)."""

from __future__ import annotations

import numpy as np

from gpucloud.scheduler import NodeState, PodRequest, Scheduler
from gpucloud.scheduler.framework.cluster import ClusterState

from .builders import node

CONFIG = {"small": {"filters": ["NodeCondition", "CpuMemoryFit", "GpuFit"],
                    "scores": {"BestFit": 1.0}, "reserve": "GpuReserve",
                    "sample_size": 16, "sample_threshold": 32}}


def _cluster(count: int, free_at: int | None = None) -> list[NodeState]:
    full = tuple([1000] * 8)
    return [node(f"n{i:03d}").gpus(8, used=() if free_at in (None, i) else full).build()
            for i in range(count)]


def test_large_cluster_scores_only_a_sample() -> None:
    state = ClusterState.from_nodes(_cluster(200))
    framework = Scheduler("small", config=CONFIG).framework(state, [])
    cycle = framework.new_cycle(PodRequest("p", gpus=1))
    candidates = framework._candidates(cycle)
    assert 4 <= candidates.size <= 16


def test_scarce_capacity_falls_back_to_every_node() -> None:
    pods = [PodRequest("p", gpus=8)]
    decision = Scheduler("small", config=CONFIG).schedule(_cluster(200, free_at=137), pods)[0]
    assert decision.placement is not None and decision.placement.node == "n137"


def test_small_cluster_scores_every_feasible_node() -> None:
    state = ClusterState.from_nodes(_cluster(20))
    framework = Scheduler("small", config=CONFIG).framework(state, [])
    candidates = framework._candidates(framework.new_cycle(PodRequest("p", gpus=1)))
    assert np.array_equal(candidates, np.arange(20))
