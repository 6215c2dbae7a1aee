"""A pod pinned to its volume's node goes there or nowhere, with its own reason."""

from __future__ import annotations

import pytest

from gpucloud.scheduler import GpuState, NodeState, PodRequest, Scheduler


def _node(name: str, free_gpus: int, total: int = 2, ready: bool = True) -> NodeState:
    gpus = tuple(GpuState(index=i, uuid=f"{name}-{i}", model="H100-80GB", memory_mib=81559,
                          used_milli=0 if i < free_gpus else 1000) for i in range(total))
    return NodeState(name=name, cpu_milli=64000, memory_bytes=1 << 40, gpus=gpus,
                     ready=ready)


@pytest.mark.parametrize("policy", ["default", "bestfit", "random"])
def test_pinned_pod_goes_to_its_node_even_when_others_are_better(policy: str) -> None:
    nodes = [_node("a", 2), _node("b", 1), _node("c", 2)]
    decision = Scheduler(policy).schedule(nodes, [PodRequest("p", gpus=1, required_node="b")])[0]
    assert decision.placement is not None and decision.placement.node == "b"


@pytest.mark.parametrize(("nodes", "reasons"), [
    ([_node("a", 2), _node("b", 0)],
     {"its volume is on node b": 1, "not enough free GPUs": 1}),
    ([_node("a", 2), _node("b", 2, ready=False)],
     {"its volume is on node b": 1, "node not ready": 1}),
    ([_node("a", 2), _node("c", 2)], {"its volume is on node b": 2}),
])
def test_pinned_pod_waits_with_the_volume_reason(nodes: list[NodeState],
                                                 reasons: dict[str, int]) -> None:
    decision = Scheduler("default").schedule(nodes, [PodRequest("p", gpus=1,
                                                                required_node="b")])[0]
    assert decision.placement is None and decision.explanation is not None
    assert decision.explanation.reasons == reasons


def test_unpinned_pods_are_unaffected() -> None:
    decision = Scheduler("default").schedule([_node("a", 0), _node("b", 1)],
                                             [PodRequest("p", gpus=1)])[0]
    assert decision.placement is not None and decision.placement.node == "b"
