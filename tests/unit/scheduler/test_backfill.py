"""Backfill: the gang's reservation, the admission rule, and that backfilled work never
delays the reserved start (simulated forward, with and without backfill)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpucloud.scheduler.backfill import (
    GangNeed,
    Holding,
    Reservation,
    Work,
    allowed_nodes,
    may_start,
    plan_backfill,
    reserve,
)

CAP = {"a": 8, "b": 8, "c": 8, "d": 4}


@pytest.mark.parametrize(("running", "gang", "start", "nodes"), [
    # Enough idle nodes: now, on nodes free now.
    ([], GangNeed(2, 8), 0.0, None),
    # One node busy until 50, another until 30: a 3-node gang needs both -> 50.
    ([Holding("x", {"a": 8}, 50.0), Holding("y", {"b": 2}, 30.0)], GangNeed(3, 8), 50.0,
     {"a", "b", "c"}),
    # Two releases on one node: ready only once both have ended.
    ([Holding("x", {"a": 4}, 10.0), Holding("y", {"a": 4}, 40.0), Holding("z", {"b": 8}, 20.0),
      Holding("w", {"c": 8}, 90.0)], GangNeed(2, 8), 40.0, {"a", "b"}),
    # The node freeing last among those needed is reserved; an idle node is kept open.
    ([Holding("x", {"a": 8}, 25.0), Holding("y", {"b": 8}, 60.0)], GangNeed(2, 8), 25.0,
     {"a", "c"}),
    # Work without a declared end blocks: start is unknown (inf).
    ([Holding("x", {"a": 8}), Holding("y", {"b": 8}, 5.0)], GangNeed(3, 8), math.inf, None),
])
def test_reservation(running: list[Holding], gang: GangNeed, start: float,
                     nodes: set[str] | None) -> None:
    found = reserve(0.0, CAP, running, gang)
    assert found is not None and found.start == start and len(found.nodes) == gang.nodes
    assert "d" not in found.nodes  # too small for 8 GPUs
    if nodes is not None:
        assert found.nodes == nodes


def test_no_reservation_when_the_cluster_is_too_small() -> None:
    assert reserve(0.0, CAP, [], GangNeed(4, 8)) is None
    assert may_start(Work("w", 8), ["a"], 0.0, None)


RES = Reservation(100.0, frozenset({"a", "b"}))


@pytest.mark.parametrize(("work", "nodes", "now", "ok"), [
    (Work("off", 4), ["c"], 0.0, True),                              # not on reserved nodes
    (Work("undeclared", 4), ["a"], 0.0, False),                      # no max duration
    (Work("short", 4, max_duration=60.0), ["a"], 0.0, True),         # ends at 60 <= 100
    (Work("exact", 4, max_duration=100.0), ["b"], 0.0, True),        # ends exactly at 100
    (Work("long", 4, max_duration=60.0), ["a"], 50.0, False),        # ends at 110 > 100
    (Work("gang", 4, nodes=2, max_duration=500.0), ["c", "a"], 0.0, False),
    (Work("inf", 4, max_duration=1.0), ["a"], 0.0, None),            # start unknown
])
def test_admission_rule(work: Work, nodes: list[str], now: float, ok: bool | None) -> None:
    reservation = RES if ok is not None else Reservation(math.inf, RES.nodes)
    assert may_start(work, nodes, now, reservation) is bool(ok)
    allowed = allowed_nodes(work, ["a", "b", "c", "d"], now, reservation)
    assert set(allowed) == ({"a", "b", "c", "d"} if ok and not set(nodes).isdisjoint(RES.nodes)
                            else {"c", "d"})


def test_plan_backfills_around_the_reservation() -> None:
    running = [Holding("x", {"a": 8}, 50.0), Holding("y", {"b": 6}, 80.0)]
    later = [Work("big", 8, max_duration=500.0), Work("forever", 2), Work("short", 8, 1, 40.0),
             Work("tiny", 2, max_duration=10.0)]
    plan = plan_backfill(0.0, CAP, running, GangNeed(2, 8), later)
    # c is free now and a frees at 50: the gang is reserved there (b frees only at 80).
    assert plan.reservation == Reservation(50.0, frozenset({"a", "c"}))
    # "big" ends too late for c and fits nowhere else; "forever" (undeclared) goes to b,
    # off the reservation; "short" ends by 50, so it may use reserved c; "tiny" takes d.
    assert plan.started == {"forever": ("b",), "short": ("c",), "tiny": ("d",)}


# --- property: simulate forward ------------------------------------------------------

Case = tuple[dict[str, int], list[Holding], list[float], GangNeed, list[Work], list[float]]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    names = [f"n{i}" for i in range(draw(st.integers(2, 6)))]
    capacity = {n: draw(st.sampled_from([4, 8])) for n in names}
    free = dict(capacity)
    running: list[Holding] = []
    actual: list[float] = []
    exact = draw(st.booleans())
    for i in range(draw(st.integers(0, 8))):
        node = draw(st.sampled_from(names))
        if free[node] == 0:
            continue
        gpus = draw(st.integers(1, free[node]))
        free[node] -= gpus
        end = float(draw(st.integers(1, 100)))
        running.append(Holding(f"r{i}", {node: gpus}, end))
        actual.append(end if exact else end * draw(st.floats(0.1, 1.0)))
    per_node = draw(st.sampled_from(sorted(set(capacity.values()))))
    large = sum(1 for c in capacity.values() if c >= per_node)
    gang = GangNeed(draw(st.integers(1, large)), per_node)
    later = [Work(f"w{i}", draw(st.integers(1, 8)), draw(st.integers(1, 2)),
                  draw(st.one_of(st.none(), st.integers(1, 150).map(float))))
             for i in range(draw(st.integers(0, 8)))]
    # Declared work runs at most its max duration; undeclared work may run very long.
    runs = [(w.max_duration if exact else w.max_duration * draw(st.floats(0.1, 1.0)))
            if w.max_duration is not None else float(draw(st.integers(1, 10_000)))
            for w in later]
    return capacity, running, actual, gang, later, runs


def gang_start(capacity: Mapping[str, int], held: Sequence[tuple[Mapping[str, int], float]],
               gang: GangNeed) -> float:
    """The first time enough nodes have the gang's GPUs free, given (GPUs, actual end)."""
    for t in sorted({0.0, *(end for _, end in held)}):
        free = dict(capacity)
        for gpus, end in held:
            if end > t:
                for node, count in gpus.items():
                    free[node] -= count
        if sum(1 for f in free.values() if f >= gang.gpus_per_node) >= gang.nodes:
            return t
    return math.inf


@settings(max_examples=300, deadline=None)
@given(cases())
def test_backfill_never_delays_the_reserved_start(case: Case) -> None:
    capacity, running, actual, gang, later, runs = case
    plan = plan_backfill(0.0, capacity, running, gang, later)
    reservation = plan.reservation
    assert reservation is not None
    base = [(h.gpus, end) for h, end in zip(running, actual, strict=True)]
    backfilled = [({node: w.gpus for node in plan.started[w.key]}, run)
                  for w, run in zip(later, runs, strict=True) if w.key in plan.started]
    without = gang_start(capacity, base, gang)
    with_backfill = gang_start(capacity, base + backfilled, gang)
    assert without <= reservation.start
    assert with_backfill <= reservation.start
    if all(h.end == end for h, end in zip(running, actual, strict=True)):
        # Exact estimates: the gang starts exactly when it would have without backfill.
        assert with_backfill == without == reservation.start
    for work in later:
        nodes = plan.started.get(work.key, ())
        if not reservation.nodes.isdisjoint(nodes):
            assert work.max_duration is not None
            assert work.max_duration <= reservation.start
