"""Table-driven tests of the public ``Scheduler`` API: feasibility, explanations, profiles."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gpucloud.scheduler import (
    POLICY_NAMES,
    Code,
    Decision,
    Explanation,
    NodeState,
    PodRequest,
    Scheduler,
)

from .builders import node, pod


@dataclass(frozen=True)
class Case:
    name: str
    nodes: tuple[NodeState, ...]
    pod: PodRequest
    node: str | None  # expected node, or None for unschedulable
    reasons: dict[str, int] | None = None


CASES = [
    Case("whole GPUs fit", (node("a").gpus(8).build(),), pod().gpus(4).build(), "a"),
    Case("share fits", (node("a").gpus(1, used=(600,)).build(),), pod().share(400).build(), "a"),
    Case("share does not fit", (node("a").gpus(1, used=(700,)).build(),),
         pod().share(400).build(), None, {"no GPU with enough free share": 1}),
    Case("not enough free GPUs", (node("a").gpus(2, used=(1, 0)).build(),),
         pod().gpus(2).build(), None, {"not enough free GPUs": 1}),
    Case("node too small", (node("a").gpus(2).build(),), pod().gpus(4).build(), None,
         {"too few GPUs on node": 1}),
    Case("cordoned", (node("a").gpus(8).cordoned().build(), node("b").gpus(8).build()),
         pod().gpus(1).build(), "b"),
    Case("not ready", (node("a").gpus(8).not_ready().build(),), pod().gpus(1).build(), None,
         {"node not ready": 1}),
    Case("model matches canonically",
         (node("a").gpus(8, "T4").build(), node("b").gpus(8, "NVIDIA H100 80GB HBM3").build()),
         pod().gpus(1).model("h100").build(), "b"),
    Case("no such model", (node("a").gpus(8, "T4").build(),),
         pod().gpus(1).model("H100-80GB").build(), None, {"no GPU of model H100-80GB": 1}),
    Case("trace models compare as-is", (node("a").gpus(8, "G2").build(),),
         pod().gpus(1).model("G3|G2").build(), "a"),
    Case("not enough CPU", (node("a").cpu(8_000, used=6_000).gpus(1).build(),),
         pod().gpus(1).cpu(4_000).build(), None, {"not enough CPU": 1}),
    Case("not enough memory", (node("a").memory(64, used_gib=60).gpus(1).build(),),
         pod().gpus(1).memory(8).build(), None, {"not enough memory": 1}),
    Case("CPU-only pod on GPU-less node", (node("a").build(),), pod().cpu(1000).build(), "a"),
    Case("GPU pod on GPU-less node", (node("a").build(),), pod().gpus(1).build(), None,
         {"too few GPUs on node": 1}),
    Case("min GPU memory", (node("a").gpus(1, "T4", 15_360).build(),
                            node("b").gpus(1, "A100-80GB", 81_920).build()),
         pod().gpus(1).min_gpu_memory(40_000).build(), "b"),
    Case("node selector", (node("a").gpus(1).labels(zone="x").build(),
                           node("b").gpus(1).labels(zone="y").build()),
         pod().gpus(1).selector(zone="y").build(), "b"),
    Case("mixed reasons", (node("a").gpus(8).cordoned().build(),
                           node("b").gpus(1).build(), node("c").gpus(2).build(),
                           node("d").gpus(4, "T4").build()),
         pod().gpus(4).model("H100-80GB").build(), None,
         {"cordoned": 1, "too few GPUs on node": 2, "no GPU of model H100-80GB": 1}),
    Case("MIG profile fits on H100", (node("a").gpus(1, "T4").build(),
                                      node("b").gpus(1).build()),
         pod().mig("3g.40gb").build(), "b"),
    Case("MIG profile of another memory size", (node("a").gpus(1).build(),),
         pod().mig("3g.20gb").build(), None, {"no GPU offering MIG profile 3g.20gb": 1}),
]


@pytest.mark.parametrize("profile", POLICY_NAMES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_feasibility(case: Case, profile: str) -> None:
    [decision] = Scheduler(profile).schedule(case.nodes, [case.pod])
    if case.node is None:
        assert decision.placement is None
        assert decision.explanation is not None
        assert decision.explanation.reasons == case.reasons
        assert decision.status.code is not Code.SUCCESS
    else:
        assert decision.placement is not None, decision.explanation
        assert decision.placement.node == case.node
        assert sum(decision.placement.gpu_milli.values()) >= case.pod.gpu_request_milli


@pytest.mark.parametrize(("reasons", "text"), [
    ({"not enough free GPUs": 3, "cordoned": 1},
     "3 nodes: not enough free GPUs; 1 node: cordoned"),
    ({"cordoned": 1}, "1 node: cordoned"),
    ({"b": 2, "a": 2}, "2 nodes: a; 2 nodes: b"),
    ({}, "no nodes in the cluster"),
])
def test_explanation_summary(reasons: dict[str, int], text: str) -> None:
    assert Explanation(reasons).summary() == text


def test_pods_see_earlier_pods_of_the_same_call() -> None:
    nodes = [node("a").gpus(2).build()]
    pods = [pod("p1").gpus(1).build(), pod("p2").gpus(1).build(), pod("p3").gpus(1).build()]
    decisions = Scheduler().schedule(nodes, pods)
    assert [d.placement is not None for d in decisions] == [True, True, False]
    used = [i for d in decisions if d.placement for i in d.placement.gpu_milli]
    assert sorted(used) == [0, 1]


def test_shares_pack_but_never_exceed_a_gpu() -> None:
    nodes = [node("a").gpus(1).build()]
    pods = [pod(f"p{i}").share(300).build() for i in range(4)]
    decisions = Scheduler().schedule(nodes, pods)
    assert [d.placement is not None for d in decisions] == [True, True, True, False]


def test_inputs_are_not_mutated() -> None:
    nodes = (node("a").gpus(2).build(),)
    before = repr(nodes)
    Scheduler().schedule(nodes, [pod().gpus(2).build()])
    assert repr(nodes) == before


def test_unknown_profile_is_named() -> None:
    with pytest.raises(ValueError, match="'nope'"):
        Scheduler("nope")


def test_profiles_from_configuration() -> None:
    config = {"spread": {"filters": ["NodeCondition", "GpuFit"], "scores": {"BestFit": -1.0},
                         "reserve": "GpuReserve"}}
    nodes = [node("a").gpus(2, used=(1000, 0)).build(), node("b").gpus(2).build()]
    [decision] = Scheduler("spread", config=config).schedule(nodes, [pod().gpus(1).build()])
    assert decision.placement is not None and decision.placement.node == "b"
    [packed] = Scheduler("bestfit").schedule(nodes, [pod().gpus(1).build()])
    assert packed.placement is not None and packed.placement.node == "a"


def test_unknown_plugin_in_configuration() -> None:
    config = {"bad": {"scores": {"NoSuchScore": 1.0}, "reserve": "GpuReserve"}}
    with pytest.raises(ValueError, match="NoSuchScore"):
        Scheduler("bad", config=config)


@pytest.mark.parametrize(("request_", "problem"), [
    (PodRequest("x", gpu_milli=1000), "gpu_milli must be 1..999"),
    (PodRequest("x", gpus=-1), "gpus must not be negative"),
    (PodRequest("x", mig_profile="9g.99gb"), "unknown MIG profile 9g.99gb"),
    (PodRequest("x", gpus=1, mig_profile="1g.10gb"), "cannot be combined"),
])
def test_invalid_requests_are_errors(request_: PodRequest, problem: str) -> None:
    [decision] = Scheduler().schedule([node("a").gpus(8).build()], [request_])
    assert decision.placement is None
    assert decision.status.code is Code.ERROR
    assert problem in decision.status.message()


def test_unresolvable_when_no_node_can_ever_fit() -> None:
    [decision] = Scheduler().schedule([node("a").gpus(8, "T4").build()],
                                      [pod().gpus(1).model("H100-80GB").build()])
    assert decision.status.code is Code.UNSCHEDULABLE_AND_UNRESOLVABLE
    [busy] = Scheduler().schedule([node("a").gpus(1, used=(1000,)).build()],
                                  [pod().gpus(1).build()])
    assert busy.status.code is Code.UNSCHEDULABLE


def test_decision_shape() -> None:
    [decision] = Scheduler().schedule([node("a").gpus(8).build()], [pod("k").gpus(8).build()])
    assert isinstance(decision, Decision)
    assert decision.pod_key == "k"
    assert decision.placement is not None
    assert decision.placement.gpu_milli == dict.fromkeys(range(8), 1000)
    assert decision.explanation is None
