"""The scheduler's GPU-sharing rules beyond milli-GPU: MIG pods only on GPUs whose MIG mode
is on, a fixed MIG layout is used as it is (a free existing instance of the profile, never
a new one), and a share's memory limit fits what the other shares' limits left on its GPU.
Examples first, then hypothesis properties over random clusters and pod streams."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpucloud.core.jobs import Topology
from gpucloud.scheduler import POLICY_NAMES, GpuState, NodeState, PodRequest, Scheduler
from gpucloud.scheduler.gang import apply_placements, place_gang
from gpucloud.scheduler.mig import MIG_SLOTS, geometry
from tests.unit.scheduler.builders import GIB

H100 = "H100-80GB"
H100_MIB = 81_559


def _gpu(index: int, node: str = "n", *, mig_mode: bool | None = None,
         mig_layout: tuple[tuple[str, int], ...] | None = None, mig_used: tuple[int, ...] = (),
         memory_used_mib: int = 0) -> GpuState:
    return GpuState(index, f"{node}-gpu{index}", H100, H100_MIB, mig_used=mig_used,
                    mig_mode=mig_mode, mig_layout=mig_layout, memory_used_mib=memory_used_mib)


def _node(name: str, *gpus: GpuState) -> NodeState:
    return NodeState(name, 64_000, 512 * GIB, gpus)


def _mig(key: str, profile: str = "1g.10gb") -> PodRequest:
    return PodRequest(key, mig_profile=profile)


def _share(key: str, milli: int, memory_mib: int = 0) -> PodRequest:
    return PodRequest(key, gpu_milli=milli, gpu_memory_mib=memory_mib)


# -- MIG mode ------------------------------------------------------------------------------


def test_mig_pod_only_on_a_gpu_whose_mig_mode_is_on() -> None:
    node = _node("n", _gpu(0, mig_mode=False), _gpu(1, mig_mode=True))
    decisions = Scheduler().schedule([node], [_mig(f"m{i}") for i in range(8)])
    placed = [d.placement for d in decisions if d.placement]
    assert len(placed) == 7 and all(set(p.mig) == {1} for p in placed)


def test_a_gpu_in_mig_mode_takes_no_whole_gpu_or_share() -> None:
    node = _node("n", _gpu(0, mig_mode=True), _gpu(1, mig_mode=False))
    decisions = Scheduler().schedule([node], [PodRequest("w", gpus=1), _share("s", 500),
                                              PodRequest("w2", gpus=1)])
    assert [sorted(d.placement.gpu_milli) if d.placement else None for d in decisions] == [
        [1], None, None]


def test_mig_mode_off_everywhere_says_so() -> None:
    off = _node("off", _gpu(0, mig_mode=False))
    t4 = NodeState("t4", 64_000, 512 * GIB, (GpuState(0, "t4-0", "T4", 15_360),))
    [decision] = Scheduler().schedule([off, t4], [_mig("m")])
    assert decision.placement is None and decision.explanation is not None
    assert decision.explanation.reasons == {"MIG mode off on its GPUs": 1,
                                            "no GPU offering MIG profile 1g.10gb": 1}


# -- fixed layouts -----------------------------------------------------------------------


def test_fixed_layout_gives_an_existing_free_instance_of_the_profile() -> None:
    layout = (("3g.40gb", 4), ("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3))
    node = _node("n", _gpu(0, mig_layout=layout, mig_used=(2,)))  # 1g@2 is held already
    decisions = Scheduler().schedule([node], [_mig("a"), _mig("b"), _mig("three", "3g.40gb"),
                                              _mig("four", "4g.40gb")])
    slots = {d.pod_key: d.placement.mig[0] if d.placement else None for d in decisions}
    assert slots == {"a": ("1g.10gb", 3), "b": None, "three": ("3g.40gb", 4), "four": None}


def test_fixed_layout_gpu_takes_no_whole_gpu_or_share() -> None:
    node = _node("n", _gpu(0, mig_layout=(("7g.80gb", 0),)))
    decisions = Scheduler().schedule([node], [PodRequest("w", gpus=1), _share("s", 500)])
    assert [d.placement for d in decisions] == [None, None]


def test_fixed_policy_with_no_instances_takes_no_mig_pod() -> None:
    [decision] = Scheduler().schedule([_node("n", _gpu(0, mig_layout=()))], [_mig("m")])
    assert decision.placement is None


# -- share memory ------------------------------------------------------------------------


def test_share_memory_limits_add_up_per_gpu() -> None:
    node = _node("n", _gpu(0), _gpu(1, memory_used_mib=70_000))
    stream = [_share("a", 200, 40_000), _share("b", 200, 40_000), _share("c", 200, 40_000)]
    decisions = Scheduler().schedule([node], stream)
    placed = [sorted(d.placement.gpu_milli) if d.placement else None for d in decisions]
    assert placed == [[0], [0], None]  # GPU 1 has 11,559 MiB left; GPU 0 80,000 after two


def test_share_without_a_limit_promises_no_memory() -> None:
    node = _node("n", _gpu(0, memory_used_mib=H100_MIB))
    decisions = Scheduler().schedule([node], [_share("free", 300), _share("limited", 300, 1)])
    assert [d.placement is not None for d in decisions] == [True, False]


# -- MIG gangs ---------------------------------------------------------------------------


def test_mig_gang_is_all_or_nothing() -> None:
    nodes = [_node("a", _gpu(0, "a")), _node("b", _gpu(0, "b", mig_mode=False)),
             _node("c", _gpu(0, "c"))]
    two = [_mig(f"r{i}", "3g.40gb") for i in range(2)]
    decision = place_gang(Scheduler(), nodes, two, Topology.ANY)
    assert decision.placements is not None
    assert sorted(p.node for p in decision.placements) == ["a", "c"]
    assert all(p.mig == {0: ("3g.40gb", 4)} or p.mig == {0: ("3g.40gb", 0)}
               for p in decision.placements)
    after = apply_placements(nodes, two, decision.placements)
    assert {n.name: n.gpus[0].mig_used for n in after} == {
        "a": (4, 5, 6, 7) if decision.placements[0].mig[0][1] == 4 else (0, 1, 2, 3),
        "b": (), "c": after[2].gpus[0].mig_used} and len(after[2].gpus[0].mig_used) == 4
    three = [_mig(f"s{i}", "3g.40gb") for i in range(3)]
    refused = place_gang(Scheduler(), nodes, three, Topology.ANY)
    assert refused.placements is None
    assert "needs 3 nodes with a free 3g.40gb MIG slot each, 2 have them" in refused.summary


# -- properties --------------------------------------------------------------------------

PROFILES = ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")


@st.composite
def _gpus(draw: st.DrawFn, node: str, index: int) -> GpuState:
    mode = draw(st.sampled_from((None, True, False)))
    layout = None
    if mode is not False and draw(st.booleans()):
        layout = tuple(draw(st.lists(st.tuples(st.sampled_from(PROFILES),
                                               st.integers(0, MIG_SLOTS - 1)), max_size=5)))
    return _gpu(index, node, mig_mode=mode, mig_layout=layout,
                memory_used_mib=draw(st.sampled_from((0, 0, 20_000, 60_000, H100_MIB))))


@st.composite
def _cluster(draw: st.DrawFn) -> list[NodeState]:
    count = draw(st.integers(1, 4))
    return [_node(f"n{i}", *(draw(_gpus(f"n{i}", g)) for g in range(draw(st.integers(1, 3)))))
            for i in range(count)]


@st.composite
def _pods(draw: st.DrawFn) -> PodRequest:
    key = f"p{draw(st.integers(0, 10**6))}"
    kind = draw(st.sampled_from(("mig", "share", "whole")))
    if kind == "mig":
        return _mig(key, draw(st.sampled_from(PROFILES)))
    if kind == "whole":
        return PodRequest(key, gpus=draw(st.integers(1, 2)))
    return _share(key, draw(st.integers(1, 999)),
                  draw(st.sampled_from((0, 10_000, 30_000, 50_000))))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=_cluster(), stream=st.lists(_pods(), min_size=1, max_size=16),
       policy=st.sampled_from(POLICY_NAMES))
def test_mig_mode_layout_and_share_memory_hold(cluster: list[NodeState],
                                               stream: list[PodRequest], policy: str) -> None:
    gpus = {(n.name, g.index): g for n in cluster for g in n.gpus}
    memory = {key: g.memory_used_mib for key, g in gpus.items()}
    taken_layout: dict[tuple[str, int], set[int]] = {key: set() for key in gpus}
    for decision, request in zip(Scheduler(policy).schedule(cluster, stream), stream,
                                 strict=True):
        placement = decision.placement
        if placement is None:
            continue
        for index, (profile, start) in placement.mig.items():
            gpu = gpus[(placement.node, index)]
            assert gpu.mig_mode is not False, "a MIG pod on a GPU whose MIG mode is off"
            geom = geometry(H100, profile)
            assert geom is not None and start in geom.starts
            if gpu.mig_layout is not None:
                assert (profile, start) in gpu.mig_layout, "an instance a fixed layout lacks"
                assert start not in taken_layout[(placement.node, index)]
                taken_layout[(placement.node, index)].add(start)
        for index in placement.gpu_milli if request.gpus else ():
            gpu = gpus[(placement.node, index)]
            assert gpu.mig_mode is not True and not gpu.mig_layout, "a whole GPU in MIG mode"
        if request.gpu_milli:
            [index] = placement.gpu_milli
            gpu = gpus[(placement.node, index)]
            assert not gpu.mig_layout, "a share on a fixed MIG layout's GPU"
            assert gpu.mig_mode is not True, "a share on a GPU in MIG mode"
            memory[(placement.node, index)] += request.gpu_memory_mib
            if request.gpu_memory_mib:
                assert memory[(placement.node, index)] <= gpu.memory_mib, "memory over-promised"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=_cluster(), members=st.integers(1, 4), profile=st.sampled_from(PROFILES))
def test_mig_gangs_are_whole_on_mig_mode_gpus_or_not_at_all(
        cluster: list[NodeState], members: int, profile: str) -> None:
    gpus = {(n.name, g.index): g for n in cluster for g in n.gpus}
    gang = [_mig(f"r{i}", profile) for i in range(members)]
    decision = place_gang(Scheduler(), cluster, gang, Topology.ANY)
    single = [d.placement is not None for d in Scheduler().schedule(cluster, gang[:1])]
    if decision.placements is None:
        fitting = sum(Scheduler().schedule([n], gang[:1])[0].placement is not None
                      for n in cluster)
        assert fitting < members, "a gang refused although enough nodes take a member"
        return
    assert single == [True] and len(decision.placements) == members
    assert len({p.node for p in decision.placements}) == members  # one member per node
    for placement in decision.placements:
        [(index, (name, start))] = placement.mig.items()
        gpu = gpus[(placement.node, index)]
        assert name == profile and gpu.mig_mode is not False
        assert gpu.mig_layout is None or (profile, start) in gpu.mig_layout
