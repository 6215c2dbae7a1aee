"""Gang placement: tightest topology first, never broken, all members or none."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from gpucloud.core.jobs import Topology
from gpucloud.scheduler import NodeState, PodRequest, Scheduler
from gpucloud.scheduler.gang import apply_placements, place_gang
from tests.unit.scheduler.builders import GIB, node


def _node(name: str, used: int = 0, **labels: str) -> NodeState:
    return node(name).gpus(8, used=(1000,) * used).labels(**labels).build()


def _members(count: int, gpus: int = 8) -> list[PodRequest]:
    return [PodRequest(key=f"m{i}", gpus=gpus, cpu_milli=1000, memory_bytes=GIB)
            for i in range(count)]


CLUSTER = [_node("a", block="b1", rack="r1"), _node("b", block="b2", rack="r1"),
           _node("c", block="b2", rack="r2"), _node("d", rack="r2"), _node("e")]


def test_tightest_domain_first_then_wider() -> None:
    scheduler = Scheduler()
    assert place_gang(scheduler, CLUSTER, _members(2), Topology.ANY).domain == "block b2"
    rack = place_gang(scheduler, CLUSTER, _members(2), Topology.SAME_RACK)
    assert rack.domain == "rack r1" and {p.node for p in rack.placements or ()} == {"a", "b"}
    spread = place_gang(scheduler, CLUSTER, _members(5), Topology.ANY)
    assert spread.domain == "the cluster" and len({p.node for p in spread.placements or ()}) == 5


def test_topology_is_never_broken_and_failures_explain() -> None:
    scheduler = Scheduler()
    block = place_gang(scheduler, CLUSTER, _members(3), Topology.SAME_BLOCK)
    assert block.placements is None
    assert block.summary == ("needs 3 nodes with 8 free GPUs each in one block (same-block); "
                             "at most 2 fit in one block (block b2)")
    busy = [_node("x", used=4), _node("y"), _node("z")]
    too_big = place_gang(scheduler, busy, _members(3), Topology.ANY)
    assert too_big.placements is None and too_big.explanation is not None
    assert too_big.explanation.reasons == {"free for a member": 2, "not enough free GPUs": 1}
    assert too_big.summary.startswith("needs 3 nodes with 8 free GPUs each, 2 have them")


def test_one_member_per_node_even_when_two_would_fit() -> None:
    decision = place_gang(Scheduler(), [_node("a"), _node("b")], _members(3, gpus=2),
                          Topology.ANY)
    assert decision.placements is None


@st.composite
def clusters(draw: st.DrawFn) -> tuple[list[NodeState], int, int, Topology]:
    count = draw(st.integers(1, 10))
    nodes = [_node(f"n{i}", used=draw(st.integers(0, 8)),
                   **draw(st.fixed_dictionaries({}, optional={
                       "block": st.sampled_from(["b1", "b2", "b3"]),
                       "rack": st.sampled_from(["r1", "r2"])})))
             for i in range(count)]
    return (nodes, draw(st.integers(1, 6)), draw(st.integers(1, 8)),
            draw(st.sampled_from(list(Topology))))


@settings(max_examples=150, deadline=None)
@given(clusters())
def test_all_or_nothing_distinct_within_topology_without_overcommit(
    case: tuple[list[NodeState], int, int, Topology]
) -> None:
    nodes, size, gpus, topology = case
    members = _members(size, gpus)
    decision = place_gang(Scheduler(), nodes, members, topology)
    by_name = {n.name: n for n in nodes}
    free = {n.name: sum(1 for g in n.gpus if g.used_milli == 0) for n in nodes}
    feasible = [n for n in nodes if free[n.name] >= gpus]
    if decision.placements is None:
        # Nothing partial, and a placement really was impossible within the topology.
        key = {Topology.SAME_BLOCK: "block", Topology.SAME_RACK: "rack"}.get(topology)
        groups = Counter(n.labels.get(key) if key else "all" for n in feasible
                         if not key or n.labels.get(key))
        assert max(groups.values(), default=0) < size
        return
    placed = [by_name[p.node] for p in decision.placements]
    assert len(placed) == size == len({n.name for n in placed})
    for key, topo in (("block", Topology.SAME_BLOCK), ("rack", Topology.SAME_RACK)):
        if topology is topo:
            assert len({n.labels.get(key) for n in placed}) == 1 and placed[0].labels.get(key)
    after = apply_placements(nodes, members, decision.placements)
    for state in after:
        assert all(g.used_milli <= 1000 for g in state.gpus)
        assert state.cpu_used_milli <= state.cpu_milli
        assert state.memory_used_bytes <= state.memory_bytes
    taken = sum(sum(p.gpu_milli.values()) for p in decision.placements)
    assert taken == size * gpus * 1000
