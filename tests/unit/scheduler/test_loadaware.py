"""LoadAware score and filter: estimates, in-flight placements, expiry, thresholds."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpucloud.scheduler import GpuState, NodeState, PodRequest, Scheduler
from gpucloud.scheduler.framework.cluster import ClusterState
from gpucloud.scheduler.plugins.loadaware import (
    CPU_THRESHOLD,
    MEMORY_THRESHOLD,
    Factors,
    LoadAwareFilter,
    LoadAwareScore,
    NodeSample,
    PodUse,
    estimate_load,
    estimated,
    set_loads,
)
from gpucloud.scheduler.types import NodeLoad

GIB = 1024**3
CPU = 32_000
MEM = 256 * GIB


def _load(cpu: float, memory: float = 0.0, *, peak_cpu: float | None = None,
          age: float = 10.0, requested_cpu: int = 0, requested_memory: int = 0,
          gpu_util: dict[int, float] | None = None) -> NodeLoad:
    return NodeLoad(age, cpu, memory, cpu if peak_cpu is None else peak_cpu, memory,
                    requested_cpu, requested_memory, gpu_util or {})


def _node(name: str, load: NodeLoad | None, cpu_used: int = 0, gpus: int = 0,
          gpu_used: tuple[int, ...] = ()) -> NodeState:
    devices = tuple(GpuState(i, f"{name}-{i}", "H100-80GB", 81_559,
                             used_milli=gpu_used[i] if i < len(gpu_used) else 0)
                    for i in range(gpus))
    return NodeState(name, CPU, MEM, devices, cpu_used_milli=cpu_used, load=load)


def _framework(profile: str, nodes: list[NodeState]) -> tuple[ClusterState, object]:
    state = ClusterState.from_nodes(nodes)
    return state, Scheduler(profile).framework(state, [])


# --- estimate_load: the Koordinator rules, one row per rule -------------------------------

@pytest.mark.parametrize(("pods", "cpu", "memory", "requested"), [
    # No pods: the sample as it is.
    ((), 4000.0, 8 * GIB, 0),
    # A pod not yet reported counts at 85 % CPU / 70 % memory of max(request, limit).
    ((PodUse(2000, 10 * GIB),), 4000 + 1700.0, 8 * GIB + 7 * GIB, 2000),
    ((PodUse(1000, GIB, cpu_limit_milli=4000, memory_limit_bytes=10 * GIB),),
     4000 + 3400.0, 8 * GIB + 7 * GIB, 1000),
    # A reported pod is in the sample already: nothing added.
    ((PodUse(2000, 10 * GIB, observed_cpu_milli=500, observed_memory_bytes=GIB),),
     4000.0, 8 * GIB, 2000),
    # A recently placed pod: its estimate minus what it already uses, floored at 0.
    ((PodUse(2000, 10 * GIB, observed_cpu_milli=500, observed_memory_bytes=GIB, recent=True),),
     4000 + 1200.0, 8 * GIB + 6 * GIB, 2000),
    ((PodUse(2000, 10 * GIB, observed_cpu_milli=3000, observed_memory_bytes=9 * GIB,
             recent=True),), 4000.0, 8 * GIB, 2000),
    # A pod ended since the sample: its use leaves at once, its request too.
    ((PodUse(2000, 10 * GIB, observed_cpu_milli=1500, observed_memory_bytes=3 * GIB,
             ended=True),), 2500.0, 5 * GIB, 0),
    # ... floored at 0 when it used more than the (smoothed) sample shows.
    ((PodUse(2000, 10 * GIB, observed_cpu_milli=9000, observed_memory_bytes=20 * GIB,
             ended=True),), 0.0, 0.0, 0),
])
def test_estimate_load(pods: tuple[PodUse, ...], cpu: float, memory: float,
                       requested: int) -> None:
    load = estimate_load(NodeSample(5.0, 4000, 8 * GIB), pods)
    assert load.cpu_milli == pytest.approx(cpu)
    assert load.memory_bytes == pytest.approx(memory)
    assert load.requested_cpu_milli == requested
    assert load.age_seconds == 5.0


def test_estimate_load_peak_gets_the_same_corrections() -> None:
    sample = NodeSample(5.0, 4000, 8 * GIB, cpu_peak_milli=9000, memory_peak_bytes=12 * GIB)
    load = estimate_load(sample, [PodUse(2000, 10 * GIB),
                                  PodUse(1000, GIB, observed_cpu_milli=1000,
                                         observed_memory_bytes=GIB, ended=True)])
    assert load.cpu_peak_milli == pytest.approx(9000 - 1000 + 1700)
    assert load.memory_peak_bytes == pytest.approx(12 * GIB - GIB + 7 * GIB)


def test_estimate_is_capped_at_the_limit() -> None:
    assert PodUse(4000, 0, cpu_limit_milli=1000).estimate(Factors()) == (1000, 0)


# --- the score ----------------------------------------------------------------------------

@pytest.mark.parametrize(("loads", "expected_best"), [
    # Real use decides between nodes with equal requests.
    ([_load(28_000), _load(2_000)], "n1"),
    ([_load(2_000), _load(28_000)], "n0"),
    # Memory counts too.
    ([_load(1_000, 200 * GIB), _load(1_000, 10 * GIB)], "n1"),
    # An expired node is scored as if each of its pods used its estimate (fail-open):
    # it holds no pods, so it looks idle, not loaded by the stale high value.
    ([_load(30_000, age=181.0), _load(8_000)], "n0"),
])
def test_score_prefers_the_less_loaded_node(loads: list[NodeLoad], expected_best: str) -> None:
    nodes = [_node(f"n{i}", load) for i, load in enumerate(loads)]
    state = ClusterState.from_nodes(nodes)
    framework = Scheduler("default+load-aware").framework(state, [])
    cycle = framework.new_cycle(PodRequest("p", cpu_milli=1000))
    scores = LoadAwareScore({}).score(cycle, state, np.arange(len(nodes)))
    assert nodes[int(np.argmax(scores))].name == expected_best


def test_score_without_metrics_counts_requests_at_their_estimate() -> None:
    nodes = [_node("busy", None, cpu_used=30_000), _node("idle", None)]
    state = ClusterState.from_nodes(nodes)
    framework = Scheduler("default+load-aware").framework(state, [])
    cycle = framework.new_cycle(PodRequest("p", cpu_milli=1000))
    scores = LoadAwareScore({"memory_weight": 0}).score(cycle, state, np.arange(2))
    assert scores[0] == pytest.approx(100 * (CPU - 0.85 * 31_000) / CPU)
    assert scores[1] == pytest.approx(100 * (CPU - 0.85 * 1_000) / CPU)


def test_gpu_share_goes_to_the_less_busy_gpu_node() -> None:
    nodes = [_node("hot", _load(0, gpu_util={0: 95.0}), gpus=1, gpu_used=(500,)),
             _node("cool", _load(0, gpu_util={0: 10.0}), gpus=1, gpu_used=(500,))]
    # Both GPUs hold 500 milli requested at the sample: the baseline for in-flight shares.
    nodes = [replace(n, load=replace(n.load, gpu_requested_milli={0: 500}))
             for n in nodes if n.load is not None]
    decision = Scheduler("default+load-aware").schedule(
        nodes, [PodRequest("share", gpu_milli=300, cpu_milli=100)])[0]
    assert decision.placement is not None and decision.placement.node == "cool"


# --- in-flight placements -----------------------------------------------------------------

def test_a_burst_is_not_stacked_on_the_node_that_looked_idle() -> None:
    """Pods placed in the same pass count at their estimate on the node they went to."""
    nodes = [_node("a", _load(10_000)), _node("b", _load(12_000))]
    pods = [PodRequest(f"p{i}", cpu_milli=4000) for i in range(4)]
    decisions = Scheduler("default+load-aware").schedule(nodes, pods)
    placed = [d.placement.node for d in decisions if d.placement is not None]
    assert sorted(placed) == ["a", "a", "b", "b"]


def test_requests_grown_since_the_sample_are_estimated() -> None:
    """A node whose requests grew after its load was taken (placed since, not reported)."""
    nodes = [_node("a", _load(10_000, requested_cpu=0), cpu_used=16_000),
             _node("b", _load(14_000, requested_cpu=16_000), cpu_used=16_000)]
    state = ClusterState.from_nodes(nodes)
    framework = Scheduler("default+load-aware").framework(state, [])
    cycle = framework.new_cycle(PodRequest("p", cpu_milli=1000))
    est = estimated(cycle, state, np.arange(2), Factors(), 180.0)
    assert est.cpu[0] == pytest.approx(10_000 + 0.85 * 17_000)
    assert est.cpu[1] == pytest.approx(14_000 + 0.85 * 1_000)


# --- the filter ---------------------------------------------------------------------------

@pytest.mark.parametrize(("load", "args", "reason"), [
    (_load(10_000), {}, None),
    # Peak, not the average, is filtered on: 0.65 × 32 cores = 20.8 cores.
    (_load(10_000, peak_cpu=20_500), {}, "CPU load would exceed 65 %"),
    (_load(10_000, peak_cpu=19_000), {}, None),
    (_load(1_000, 250 * GIB), {}, "memory load would exceed 95 %"),
    (_load(10_000, peak_cpu=20_500), {"cpu_threshold": 80}, None),
    # Expired metrics: fail-open by default, rejected with fail_closed.
    (_load(31_000, age=200.0), {}, None),
    (_load(31_000, age=200.0), {"fail_closed": True}, "node load metrics expired"),
    (None, {"fail_closed": True}, "node load metrics expired"),
    (_load(31_000, age=100.0), {"expiry_seconds": 60}, None),
])
def test_filter(load: NodeLoad | None, args: dict[str, object], reason: str | None) -> None:
    state = ClusterState.from_nodes([_node("n", load)])
    framework = Scheduler("default").framework(state, [])
    cycle = framework.new_cycle(PodRequest("p", cpu_milli=1000, memory_bytes=GIB))
    rejected = [r for r, mask in LoadAwareFilter(args).filter(cycle, state, np.arange(1))
                if mask.any()]
    assert rejected == ([] if reason is None else [reason])


def test_filter_reason_is_reported_to_the_pod_owner() -> None:
    nodes = [_node("n", _load(25_000))]
    decision = Scheduler("default+load-aware-filter").schedule(
        nodes, [PodRequest("p", cpu_milli=1000)])[0]
    assert decision.placement is None and decision.explanation is not None
    assert decision.explanation.reasons == {"CPU load would exceed 65 %": 1}


def test_set_loads_replaces_cached_arrays() -> None:
    state = ClusterState.from_nodes([_node("n", _load(25_000))])
    framework = Scheduler("default+load-aware-filter").framework(state, [])
    pod = PodRequest("p", cpu_milli=1000)
    assert framework.schedule(pod).allocation is None
    set_loads(state, [_load(1_000)])
    assert framework.schedule(pod).allocation is not None


def test_bad_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu_threshold"):
        LoadAwareFilter({"cpu_threshold": -5})


# --- property: fresh data, any burst, the filter never admits above its thresholds --------

_loads = st.builds(
    lambda cpu, extra, mem, req, age: _load(cpu, mem, peak_cpu=cpu + extra, age=age,
                                            requested_cpu=req),
    st.floats(0, 30_000), st.floats(0, 5_000), st.floats(0, 250 * GIB),
    st.integers(0, 16_000), st.floats(0, 180))


@settings(max_examples=60, deadline=None)
@given(loads=st.lists(_loads, min_size=1, max_size=6),
       used=st.lists(st.integers(0, 16_000), min_size=6, max_size=6),
       pods=st.lists(st.tuples(st.integers(0, 8_000), st.integers(0, 32)),
                     min_size=1, max_size=12))
def test_filter_never_admits_above_threshold(loads: list[NodeLoad], used: list[int],
                                             pods: list[tuple[int, int]]) -> None:
    nodes = [_node(f"n{i}", load, cpu_used=used[i]) for i, load in enumerate(loads)]
    state = ClusterState.from_nodes(nodes)
    framework = Scheduler("default+load-aware-filter").framework(state, [])
    requests = [PodRequest(f"p{i}", cpu_milli=c, memory_bytes=m * GIB)
                for i, (c, m) in enumerate(pods)]
    placed: dict[int, list[PodRequest]] = {}
    for pod in requests:
        outcome = framework.schedule(pod)
        if outcome.allocation is not None:
            placed.setdefault(outcome.allocation.node, []).append(pod)
    for i, taken in placed.items():
        load = loads[i]
        grown = max(0, used[i] + sum(p.cpu_milli for p in taken) - load.requested_cpu_milli)
        cpu = load.cpu_peak_milli + 0.85 * grown
        memory = load.memory_peak_bytes + 0.70 * sum(p.memory_bytes for p in taken)
        assert cpu <= CPU_THRESHOLD / 100 * CPU + 1e-6
        assert memory <= MEMORY_THRESHOLD / 100 * MEM + 1e-6
