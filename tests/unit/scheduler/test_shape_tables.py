"""Shape tables (``framework/tables.py``): a framework that reads each shape's filter
verdicts and scores from its tables decides exactly as one that runs every plugin on
every pod's candidates, placements and releases interleaved, sampled or not; a profile
with a plugin that is not node-local never uses them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from gpucloud.scheduler import PodRequest, Scheduler
from gpucloud.scheduler.framework.cluster import Allocation, ClusterState
from gpucloud.scheduler.framework.runner import Framework
from gpucloud.scheduler.types import FULL_GPU_MILLI, NodeState

from .builders import node, pod

#: A sampled profile on a small cluster: ``default`` with a sample of 16 above 32 nodes.
SAMPLED: dict[str, dict[str, Any]] = {"sampled": {"pre_filters": ["RequestCheck"],
                       "filters": ["NodeCondition", "NodeSelector", "GpuModel", "CpuMemoryFit",
                                   "GpuFit"],
                       "scores": {"FGD": 1.0, "Topology": 0.01}, "reserve": "FgdReserve",
                       "sample_size": 16, "sample_threshold": 32,
                       "args": {"FGD": {"refined": True}, "FgdReserve": {"refined": True}}}}


def _cluster(count: int, seed: int) -> list[NodeState]:
    rng = np.random.default_rng(seed)
    nodes = []
    for i in range(count):
        used = tuple(int(u) for u in rng.choice([0, 0, 0, 250, 500, 1000], size=8))
        builder = node(f"n{i:03d}").gpus(8, "A100-80GB" if i % 4 == 0 else "H100-80GB",
                                         used=used, nvlink=i % 2 == 0, numa_split=True)
        if i % 7 == 0:
            builder = builder.labels(zone="b")
        if i % 11 == 0:
            builder = builder.cordoned()
        nodes.append(builder.cpu(64_000, used=int(rng.integers(0, 48_000))).build())
    return nodes


def _stream(count: int, seed: int) -> list[PodRequest]:
    """Few shapes, many pods of each (a backlog), in a random order."""
    shapes = [pod().gpus(1).cpu(2000), pod().gpus(2).cpu(8000), pod().gpus(4).cpu(16_000),
              pod().share(500).cpu(1000), pod().share(250).cpu(1000),
              pod().gpus(1).model("A100-80GB"), pod().gpus(1).selector(zone="b"),
              pod().cpu(4000)]
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(shapes), size=count, p=[.3, .1, .05, .2, .1, .1, .1, .05])
    out = []
    for i, k in enumerate(picks):
        request = shapes[int(k)].build()
        out.append(PodRequest(**{**request.__dict__, "key": f"p{i}"}))
    return out


def _release(state: ClusterState, alloc: Allocation) -> None:
    """Give a placement back as the job simulator does (the node's version bumped)."""
    state.cpu_free[alloc.node] += alloc.cpu_milli
    state.mem_free[alloc.node] += alloc.memory_bytes
    for col, milli in alloc.gpu_milli.items():
        state.gpu_free[alloc.node, col] = min(state.gpu_free[alloc.node, col] + milli,
                                              FULL_GPU_MILLI)
    state.refresh_summaries(alloc.node)
    state.version += 1
    state.node_version[alloc.node] = state.version


def _run(profile: str, nodes: list[NodeState], pods: list[PodRequest], tables: bool,
         config: Mapping[str, Mapping[str, Any]] | None = None) -> list[tuple[object, ...]]:
    scheduler = Scheduler(profile, config=config, seed=3)
    state = ClusterState.from_nodes(nodes)
    base = scheduler.framework(state, pods)
    framework = Framework(base.profile, state, 3, shape_tables=tables)
    placed: list[Allocation] = []
    out: list[tuple[object, ...]] = []
    for i, request in enumerate(pods):
        outcome = framework.schedule(request)
        out.append((request.key, outcome.status.code, tuple(sorted(outcome.reasons.items())),
                    None if outcome.allocation is None else
                    (outcome.allocation.node, tuple(sorted(outcome.allocation.gpu_milli.items())))))
        if outcome.allocation is not None:
            placed.append(outcome.allocation)
        if i % 5 == 4 and placed:  # some pods end: their nodes change under the tables
            _release(state, placed.pop(len(placed) // 2))
    return out


@pytest.mark.parametrize(("profile", "count"), [("default", 30), ("sampled", 40),
                                                ("fgd", 30), ("packing", 30),
                                                ("dotprod", 30), ("clustering", 30)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tables_decide_as_the_plugins_do(profile: str, count: int, seed: int) -> None:
    nodes, pods = _cluster(count, seed), _stream(300, seed)
    with_tables = _run(profile, nodes, pods, True, SAMPLED)
    assert with_tables == _run(profile, nodes, pods, False, SAMPLED)
    assert sum(d[3] is not None for d in with_tables) > 100  # most placed: a real test
    assert any(d[3] is None for d in with_tables)  # and some not (the cluster fills)


def test_a_profile_with_a_plugin_that_is_not_node_local_keeps_the_plain_path() -> None:
    nodes = _cluster(20, 0)
    for name in ("bestfit", "random", "default+load-aware"):
        scheduler = Scheduler(name)
        framework = scheduler.framework(ClusterState.from_nodes(nodes), [])
        assert not framework._tables.enabled, name
    framework = Scheduler("default").framework(ClusterState.from_nodes(nodes), [])
    assert framework._tables.enabled
