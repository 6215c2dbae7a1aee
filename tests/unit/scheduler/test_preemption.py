"""Victim selection: strictly lower priority (or equal-priority borrowed work, reclaimed by an
owner within its quota), fewest victims, lowest priority, least GPU-time lost; gangs whole;
never within another project's quota for a borrower or a reclaim."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpucloud.core.jobs import Topology
from gpucloud.scheduler import NodeState, PodRequest, Scheduler
from gpucloud.scheduler.preemption import (
    Member,
    PreemptionPlan,
    Preemptor,
    Running,
    plan_preemption,
    without_victims,
)
from gpucloud.scheduler.quota import Ledger, Quota
from tests.unit.scheduler.builders import GIB, node

H100 = "H100-80GB"
NOW = 10_000.0


def pod_on(key: str, where: str, gpus: Sequence[int], priority: int = 0,
           project: str = "p", started: float = 0.0) -> Running:
    return Running(key, priority, project, started,
                   (Member(where, {i: 1000 for i in gpus}, 1000, GIB),))


def gang_on(key: str, where: dict[str, Sequence[int]], priority: int = 0,
            project: str = "p", started: float = 0.0) -> Running:
    return Running(key, priority, project, started,
                   tuple(Member(n, {i: 1000 for i in g}, 1000, GIB) for n, g in where.items()))


def cluster(names: str, running: Sequence[Running], gpus: int = 8,
            **labels: dict[str, str]) -> list[NodeState]:
    """Nodes whose usage is exactly the running work's."""
    used: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    cpu: dict[str, int] = defaultdict(int)
    for unit in running:
        for m in unit.members:
            for i, milli in m.gpu_milli.items():
                used[m.node][i] += milli
            cpu[m.node] += m.cpu_milli
    nodes = []
    for name in names:
        built = node(name).gpus(gpus, used=tuple(used[name][i] for i in range(gpus)))
        state = built.labels(**labels.get(name, {})).build()
        nodes.append(replace(state, cpu_used_milli=cpu[name]))
    return nodes


def wants(gpus: int, members: int = 1, priority: int = 1000, project: str = "q",
          borrowing: bool = False, topology: Topology = Topology.ANY,
          reclaiming: bool = False) -> Preemptor:
    return Preemptor("new", priority, project,
                     tuple(PodRequest(f"new-{r}", gpus=gpus, cpu_milli=1000, memory_bytes=GIB)
                           for r in range(members)), topology, borrowing, reclaiming)


def plan(running: list[Running], preemptor: Preemptor, names: str = "ab",
         ledger: Ledger | None = None, **labels: dict[str, str]) -> PreemptionPlan | None:
    return plan_preemption(Scheduler(), cluster(names, running, **labels), running, preemptor,
                           ledger or Ledger({}), NOW)


def victims(result: PreemptionPlan | None) -> list[str]:
    assert result is not None
    return sorted(v.key for v in result.victims)


FULL = [pod_on(f"a{i}", "a", [2 * i, 2 * i + 1]) for i in range(4)] + [
    pod_on(f"b{i}", "b", [2 * i, 2 * i + 1]) for i in range(4)]


@pytest.mark.parametrize(("running", "preemptor", "expected"), [
    # just enough victims: 4 GPUs need two 2-GPU pods, on one node
    (FULL, wants(4), ["a0", "a1"]),
    # fewest victims beats anything else: one 4-GPU pod on b rather than two on a
    ([*FULL[:4], pod_on("big", "b", range(4), priority=100), *FULL[6:]], wants(4), ["big"]),
    # equal count: the lower priority goes
    ([pod_on("a0", "a", range(8), priority=100), pod_on("b0", "b", range(8), priority=0)],
     wants(8), ["b0"]),
    # equal count and priority: the least GPU-time lost (started last) goes
    ([pod_on("a0", "a", range(8), started=100), pod_on("b0", "b", range(8), started=5000)],
     wants(8), ["b0"]),
    # a reprieve: the lowest-priority pod alone is not enough and is then not needed
    ([pod_on("tiny", "a", [0], priority=0), pod_on("a1", "a", range(1, 8), priority=50),
      pod_on("b0", "b", range(8), priority=500)], wants(7), ["a1"]),
])
def test_victim_selection(running: list[Running], preemptor: Preemptor,
                          expected: list[str]) -> None:
    assert victims(plan(running, preemptor)) == expected


@pytest.mark.parametrize("priority", [0, 100])
def test_never_for_equal_or_lower_priority(priority: int) -> None:
    running = [pod_on("a0", "a", range(8), priority=100), pod_on("b0", "b", range(8),
                                                                  priority=100)]
    assert plan(running, wants(8, priority=priority)) is None


def test_gangs_go_whole_and_count_every_member() -> None:
    running = [gang_on("g", {"a": range(8), "b": range(8)}), pod_on("c0", "c", range(4)),
               pod_on("c1", "c", range(4, 8))]
    result = plan(running, wants(8), names="abc")
    assert victims(result) == ["c0", "c1"]  # two pods < a 2-member gang
    assert victims(plan(running[:1], wants(8), names="ab")) == ["g"]


def test_a_gang_preemptor_gets_distinct_nodes_within_its_topology() -> None:
    running = [pod_on(n, n, range(8)) for n in "abcd"]
    labels = {"a": {"rack": "r1"}, "b": {"rack": "r2"}, "c": {"rack": "r2"},
              "d": {"rack": "r3"}}
    result = plan(running, wants(8, members=2, topology=Topology.SAME_RACK), names="abcd",
                  **labels)
    assert victims(result) == ["b", "c"]
    assert result is not None
    assert sorted(p.node for p in result.placements) == ["b", "c"]


def test_a_borrower_never_takes_work_within_another_projects_quota() -> None:
    running = [pod_on("own", "a", range(8), project="owner"),
               pod_on("lent", "b", range(8), project="borrower")]
    ledger = Ledger({"owner": Quota({H100: 8}, 0)})
    for unit in running:
        ledger.add(unit.project, H100, 8000)
    assert victims(plan(running, wants(8, borrowing=True), ledger=ledger)) == ["lent"]
    assert plan(running[:1], wants(8, borrowing=True), names="a", ledger=ledger) is None
    # the owner itself, within its quota, reclaims what was lent
    assert victims(plan(running[1:], wants(8, project="owner"), names="b",
                        ledger=ledger)) == ["lent"]


def _ledger(running: Sequence[Running], **quotas: int) -> Ledger:
    ledger = Ledger({project: Quota({H100: gpus}, None) for project, gpus in quotas.items()})
    for unit in running:
        for m in unit.members:
            ledger.add(unit.project, H100, sum(m.gpu_milli.values()))
    return ledger


def test_an_owner_reclaims_borrowed_work_of_its_own_priority() -> None:
    # the borrower holds 16 GPUs on a quota of 8: one of its 8-GPU pods is borrowed
    running = [pod_on("b0", "a", range(8), 100, "borrower", started=10),
               pod_on("b1", "b", range(8), 100, "borrower", started=20)]
    ledger = _ledger(running, owner=8, borrower=8)
    owner = wants(8, priority=100, project="owner", reclaiming=True)
    result = plan(running, owner, ledger=ledger)
    assert victims(result) == ["b1"]  # the least GPU-time lost
    assert result is not None and result.reclaimed == frozenset({"b1"})
    # not without the owner's standing, not once the borrower is back within its quota
    assert plan(running, replace(owner, reclaiming=False), ledger=ledger) is None
    assert plan(running, owner, ledger=_ledger(running, owner=8, borrower=16)) is None
    # nor from its own project, nor work of higher priority
    assert plan(running, replace(owner, project="borrower"), ledger=ledger) is None
    assert plan(running, replace(owner, priority=50), ledger=ledger) is None


def test_reclaim_takes_only_what_was_borrowed_and_prefers_lower_priority() -> None:
    # 8 of the borrower's 12 GPUs are its quota: only the 4-GPU pod is borrowed, and a
    # 4-GPU reclaim leaves it at its quota while an 8-GPU one would not
    running = [pod_on("in-quota", "a", range(8), 100, "borrower"),
               pod_on("lent", "b", range(4), 100, "borrower"),
               pod_on("cheap", "b", range(4, 8), 0, "third")]
    ledger = _ledger(running, owner=8, borrower=8)
    assert plan(running, wants(8, priority=100, project="owner", reclaiming=True),
                ledger=ledger) is not None  # both of b's pods: lent (reclaim) and cheap
    result = plan(running, wants(4, priority=100, project="owner", reclaiming=True),
                  ledger=ledger)
    assert victims(result) == ["cheap"] and result is not None and not result.reclaimed
    # the third project's pod, now of equal priority and within its own quota, stays
    guarded = [replace(u, priority=100) if u.key == "cheap" else u for u in running]
    assert victims(plan(guarded, wants(4, priority=100, project="owner", reclaiming=True),
                        ledger=_ledger(guarded, owner=8, borrower=8, third=4))) == ["lent"]
    full_a = [u for u in running if u.key == "in-quota"]
    assert plan(full_a, wants(8, priority=100, project="owner", reclaiming=True), names="a",
                ledger=ledger) is None


def test_a_reclaimed_gang_goes_whole() -> None:
    running = [gang_on("g", {"a": range(8), "b": range(8)}, 100, "borrower")]
    ledger = _ledger(running, owner=8)
    assert victims(plan(running, wants(8, priority=100, project="owner", reclaiming=True),
                        ledger=ledger)) == ["g"]


# -- properties --------------------------------------------------------------------------


@st.composite
def workloads(draw: st.DrawFn, priorities: Sequence[int] = (0, 100, 1000)
              ) -> tuple[list[NodeState], list[Running], Preemptor, Ledger]:
    names = "abcdef"[:draw(st.integers(2, 6))]
    projects = ["x", "y", "z"]
    running: list[Running] = []
    free = {n: list(range(8)) for n in names}
    for k in range(draw(st.integers(0, 14))):
        size = draw(st.sampled_from([1, 2, 4, 8]))
        span = draw(st.integers(1, 2))
        hosts = [n for n in names if len(free[n]) >= size][:span]
        if not hosts:
            break
        members = tuple(Member(h, {i: 1000 for i in free[h][:size]}, 500, GIB) for h in hosts)
        for h in hosts:
            free[h] = free[h][size:]
        running.append(Running(f"w{k}", draw(st.sampled_from(priorities)),
                               draw(st.sampled_from(projects)),
                               draw(st.floats(0, NOW)), members))
    quotas = {p: Quota({H100: draw(st.integers(0, 16))}, draw(st.sampled_from([0, 4, None])))
              for p in projects if draw(st.booleans())}
    ledger = Ledger(quotas)
    for unit in running:
        for m in unit.members:
            ledger.add(unit.project, H100, sum(m.gpu_milli.values()))
    project = draw(st.sampled_from(projects))
    gpus, members = draw(st.sampled_from([1, 2, 4, 8])), draw(st.integers(1, 2))
    borrowing = ledger.would_borrow(project, H100, gpus * members * 1000)
    preemptor = wants(gpus, members, draw(st.sampled_from(priorities)), project,
                      borrowing, reclaiming=not borrowing)
    return cluster(names, running), running, preemptor, ledger


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(workloads(), workloads(priorities=[100])))
def test_plans_respect_priority_quota_and_capacity(
    case: tuple[list[NodeState], list[Running], Preemptor, Ledger]
) -> None:
    nodes, running, preemptor, ledger = case
    result = plan_preemption(Scheduler(), nodes, running, preemptor, ledger, NOW)
    if result is None:
        return
    # strictly lower priority, or equal priority reclaimed by an owner within its quota
    # from another project; never higher; whole units only
    for victim in result.victims:
        assert victim.priority < preemptor.priority or (
            victim.priority == preemptor.priority and preemptor.reclaiming
            and victim.project != preemptor.project and victim.key in result.reclaimed)
    assert all(v in running for v in result.victims)
    # a borrower, and a reclaim, leave the other project at least at its quota
    reclaimed = {v.project for v in result.victims if v.key in result.reclaimed}
    for project in {v.project for v in result.victims} - {preemptor.project}:
        if preemptor.borrowing or project in reclaimed:
            taken = sum(sum(m.gpu_milli.values()) for v in result.victims
                        if v.project == project for m in v.members)
            assert not ledger.protected(project, H100, taken)
    # the preemptor fits on distinct nodes without over-committing anything
    after = {n.name: n for n in without_victims(nodes, result.victims)}
    assert len({p.node for p in result.placements}) == len(preemptor.members)
    for placement in result.placements:
        gpus = {g.index: g for g in after[placement.node].gpus}
        for index, milli in placement.gpu_milli.items():
            assert gpus[index].used_milli + milli <= 1000
