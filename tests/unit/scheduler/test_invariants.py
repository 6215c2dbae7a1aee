"""Hypothesis properties over random clusters and pod streams, for every policy: no GPU
above 1000 milli, CPU and memory never over-committed, placements only on feasible
nodes, MIG instances on valid, non-overlapping start slots."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpucloud.scheduler import POLICY_NAMES, GpuState, NodeState, PodRequest, Scheduler
from gpucloud.scheduler.mig import MIG_PROFILES

GIB = 1024**3
MODELS = ("H100-80GB", "A100-40GB", "T4", "G2")


@st.composite
def nodes(draw: st.DrawFn) -> NodeState:
    name = f"n{draw(st.integers(0, 10**6))}"
    model = draw(st.sampled_from(MODELS))
    count = draw(st.integers(0, 8))
    gpus = tuple(GpuState(i, f"{name}-{i}", model, 0, numa_node=i % 2,
                          used_milli=draw(st.sampled_from((0, 0, 300, 1000))))
                 for i in range(count))
    cpu = draw(st.integers(1, 64)) * 1000
    return NodeState(name, cpu, draw(st.integers(1, 256)) * GIB, gpus,
                     cordoned=draw(st.booleans()) and draw(st.booleans()),
                     ready=not (draw(st.booleans()) and draw(st.booleans())),
                     cpu_used_milli=draw(st.integers(0, cpu)))


@st.composite
def pods(draw: st.DrawFn) -> PodRequest:
    kind = draw(st.sampled_from(("cpu", "share", "whole", "mig")))
    cpu = draw(st.integers(0, 16)) * 1000
    mem = draw(st.integers(0, 32)) * GIB
    model = draw(st.sampled_from((None, None, *MODELS)))
    key = f"p{draw(st.integers(0, 10**6))}"
    if kind == "share":
        return PodRequest(key, gpu_milli=draw(st.integers(1, 999)), gpu_model=model,
                          cpu_milli=cpu, memory_bytes=mem)
    if kind == "whole":
        return PodRequest(key, gpus=draw(st.integers(1, 8)), gpu_model=model, cpu_milli=cpu,
                          memory_bytes=mem)
    if kind == "mig":
        return PodRequest(key, mig_profile=draw(st.sampled_from(
            ("1g.10gb", "3g.40gb", "7g.80gb", "1g.5gb", "2g.10gb"))), cpu_milli=cpu)
    return PodRequest(key, cpu_milli=cpu, memory_bytes=mem)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=st.lists(nodes(), min_size=1, max_size=6, unique_by=lambda n: n.name),
       stream=st.lists(pods(), min_size=1, max_size=25),
       policy=st.sampled_from(POLICY_NAMES))
def test_never_overcommits(cluster: list[NodeState], stream: list[PodRequest],
                           policy: str) -> None:
    by_name = {n.name: n for n in cluster}
    gpu_used = {(n.name, g.index): g.used_milli for n in cluster for g in n.gpus}
    cpu_used = {n.name: n.cpu_used_milli for n in cluster}
    mem_used = {n.name: n.memory_used_bytes for n in cluster}
    mig_slots: dict[tuple[str, int], int] = {}
    for decision, pod in zip(Scheduler(policy).schedule(cluster, stream), stream, strict=True):
        placement = decision.placement
        if placement is None:
            assert decision.explanation is not None or not decision.status.ok
            continue
        node = by_name[placement.node]
        assert node.ready and not node.cordoned
        cpu_used[node.name] += pod.cpu_milli
        mem_used[node.name] += pod.memory_bytes
        assert cpu_used[node.name] <= node.cpu_milli
        assert mem_used[node.name] <= node.memory_bytes
        gpus = {g.index: g for g in node.gpus}
        if pod.mig_profile:
            [(index, (profile, start))] = placement.mig.items()
            geom = MIG_PROFILES[gpus[index].model][profile]
            assert start in geom.starts
            mask = geom.mask(start)
            assert mig_slots.get((node.name, index), 0) & mask == 0
            assert gpu_used[(node.name, index)] in (0, -1)  # untouched or MIG mode
            mig_slots[(node.name, index)] = mig_slots.get((node.name, index), 0) | mask
            gpu_used[(node.name, index)] = -1
            continue
        assert sum(placement.gpu_milli.values()) == pod.gpu_request_milli
        for index, milli in placement.gpu_milli.items():
            if pod.gpu_model:
                assert gpus[index].model in pod.gpu_model.split("|") or \
                    gpus[index].model == pod.gpu_model
            assert gpu_used[(node.name, index)] >= 0  # not a MIG GPU
            gpu_used[(node.name, index)] += milli
            assert gpu_used[(node.name, index)] <= 1000
