"""Backfill: the gang's reservation over GPUs, CPU and memory, the admission rule, and that
backfilled work never delays the reserved start (simulated forward, with and without
backfill)."""

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
    Resources,
    Work,
    allowed_nodes,
    may_start,
    plan_backfill,
    reserve,
)

GIB = 1024**3
CAP = {"a": Resources(8), "b": Resources(8), "c": Resources(8), "d": Resources(4)}


def hold(key: str, end: float | None = None, **gpus: int) -> Holding:
    """Running work holding ``gpus`` whole GPUs per node (no CPU or memory)."""
    return Holding(key, {node: Resources(count) for node, count in gpus.items()}, end)


@pytest.mark.parametrize(("left", "right", "fits", "total", "diff"), [
    (Resources(1, 2, 3), Resources(1, 2, 3), True, Resources(2, 4, 6), Resources()),
    (Resources(2), Resources(1, 5, 5), False, Resources(3, 5, 5), Resources(1, -5, -5)),
    (Resources(0, 3), Resources(8, 2, 9), False, Resources(8, 5, 9), Resources(-8, 1, -9)),
    (Resources(0, 0, 4), Resources(8, 8, 3), False, Resources(8, 8, 7), Resources(-8, -8, 1)),
])
def test_resources(left: Resources, right: Resources, fits: bool, total: Resources,
                   diff: Resources) -> None:
    assert left.fits(right) is fits
    assert (left + right, left - right) == (total, diff)


@pytest.mark.parametrize(("running", "gang", "start", "nodes"), [
    # Enough idle nodes: now, on nodes free now.
    ([], GangNeed(2, 8), 0.0, None),
    # One node busy until 50, another until 30: a 3-node gang needs both -> 50.
    ([hold("x", 50.0, a=8), hold("y", 30.0, b=2)], GangNeed(3, 8), 50.0, {"a", "b", "c"}),
    # Two releases on one node: ready only once both have ended.
    ([hold("x", 10.0, a=4), hold("y", 40.0, a=4), hold("z", 20.0, b=8), hold("w", 90.0, c=8)],
     GangNeed(2, 8), 40.0, {"a", "b"}),
    # The node freeing last among those needed is reserved; an idle node is kept open.
    ([hold("x", 25.0, a=8), hold("y", 60.0, b=8)], GangNeed(2, 8), 25.0, {"a", "c"}),
    # Work without a declared end blocks: start is unknown (inf).
    ([hold("x", a=8), hold("y", 5.0, b=8)], GangNeed(3, 8), math.inf, None),
])
def test_reservation(running: list[Holding], gang: GangNeed, start: float,
                     nodes: set[str] | None) -> None:
    found = reserve(0.0, CAP, running, gang)
    assert found is not None and found.start == start and len(found.nodes) == gang.nodes
    assert "d" not in found.nodes  # too small for 8 GPUs
    if nodes is not None:
        assert found.nodes == nodes


def test_nodes_freeing_at_the_same_time_are_taken_by_name_whatever_the_order() -> None:
    """c frees at 5, a and b at 10: the start is 10, on c and a, however the running work
    is listed."""
    running = [hold("on-b", 10.0, b=8), hold("on-a", 10.0, a=8), hold("on-c", 5.0, c=8)]
    for order in (running, running[::-1]):
        assert reserve(0.0, CAP, order, GangNeed(2, 8)) == Reservation(10.0, frozenset("ac"))


def test_no_reservation_when_the_cluster_is_too_small() -> None:
    assert reserve(0.0, CAP, [], GangNeed(4, 8)) is None
    assert may_start(Work("w", 8), ["a"], 0.0, None)
    # three nodes have 8 GPUs, but only two have the memory a member needs
    cap = {"a": Resources(8, 0, 128 * GIB), "b": Resources(8, 0, 512 * GIB),
           "c": Resources(8, 0, 512 * GIB)}
    assert reserve(0.0, cap, [], GangNeed(3, 8, memory_bytes=256 * GIB)) is None
    assert reserve(0.0, cap, [], GangNeed(2, 8, memory_bytes=256 * GIB)) == Reservation(
        0.0, frozenset("bc"))


# Three nodes whose GPUs are (mostly) free throughout; other work holds their CPU or memory.
NODE = Resources(8, 64_000, 512 * GIB)
WIDE = {"a": NODE, "b": NODE, "c": NODE}


@pytest.mark.parametrize(("blocking", "gang"), [
    (Resources(0, 48_000, 0), GangNeed(2, 4, cpu_milli=32_000)),
    (Resources(0, 0, 400 * GIB), GangNeed(2, 4, memory_bytes=256 * GIB)),
    (Resources(2, 48_000, 400 * GIB), GangNeed(2, 4, 32_000, 256 * GIB)),
], ids=["cpu", "memory", "both"])
def test_a_head_blocked_by_cpu_or_memory_is_reserved_when_enough_frees(
        blocking: Resources, gang: GangNeed) -> None:
    running = [Holding(f"on-{n}", {n: blocking}, end)
               for n, end in (("a", 30.0), ("b", 70.0), ("c", 50.0))]
    # By GPU counts alone the gang would fit now.
    assert reserve(0.0, WIDE, running, GangNeed(2, 4)) == Reservation(0.0, frozenset("ab"))
    assert reserve(0.0, WIDE, running, gang) == Reservation(50.0, frozenset("ac"))
    # Work that holds it for ever on c: b is the second node, at 70.
    forever = [*running[:2], Holding("on-c", {"c": blocking})]
    assert reserve(0.0, WIDE, forever, gang) == Reservation(70.0, frozenset("ab"))
    # ... and on b too: no known start; a (ready at 30) and one of the others.
    stuck = [running[0], Holding("on-b", {"b": blocking}), Holding("on-c", {"c": blocking})]
    found = reserve(0.0, WIDE, stuck, gang)
    assert found is not None and found.start == math.inf and "a" in found.nodes


def test_backfill_checks_cpu_and_memory_as_well_as_gpus() -> None:
    running = [Holding("cpu-hog", {"a": Resources(0, 60_000, 0)}, 40.0),
               Holding("memory-hog", {"b": Resources(0, 0, 500 * GIB)}, 80.0)]
    later = [Work("needs-cpu", 2, cpu_milli=8_000, max_duration=10.0),
             Work("needs-memory", 2, memory_bytes=64 * GIB),
             Work("pair", 1, nodes=2, cpu_milli=1_000, memory_bytes=GIB, max_duration=10.0)]
    plan = plan_backfill(0.0, WIDE, running, GangNeed(2, 4, 32_000, 256 * GIB), later)
    # a lacks CPU until 40, b memory until 80: the gang gets c now and a at 40.
    assert plan.reservation == Reservation(40.0, frozenset("ac"))
    # "needs-cpu" ends in time but a lacks the CPU: best fit b (less memory free than c);
    # "needs-memory" (undeclared) may use only b, which lacks the memory; "pair" ends in
    # time and takes the two nodes with the least free: b (fewer GPUs), then a (less CPU).
    assert plan.started == {"needs-cpu": ("b",), "pair": ("b", "a")}


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
    running = [hold("x", 50.0, a=8), hold("y", 80.0, b=6)]
    later = [Work("big", 8, max_duration=500.0), Work("forever", 2), Work("short", 8, 1, 40.0),
             Work("tiny", 2, max_duration=10.0)]
    plan = plan_backfill(0.0, CAP, running, GangNeed(2, 8), later)
    # c is free now and a frees at 50: the gang is reserved there (b frees only at 80).
    assert plan.reservation == Reservation(50.0, frozenset({"a", "c"}))
    # "big" ends too late for c and fits nowhere else; "forever" (undeclared) goes to b,
    # off the reservation; "short" ends by 50, so it may use reserved c; "tiny" takes d.
    assert plan.started == {"forever": ("b",), "short": ("c",), "tiny": ("d",)}


# --- property: simulate forward ------------------------------------------------------


Case = tuple[dict[str, Resources], list[Holding], list[float], GangNeed, list[Work], list[float]]
#: (what it holds per node, when it actually ends)
Held = tuple[Mapping[str, Resources], float]


@st.composite
def resources_within(draw: st.DrawFn, free: Resources) -> Resources:
    """Resources no larger than ``free``, with at least one GPU when ``free`` has one."""
    return Resources(draw(st.integers(min(1, free.gpus), free.gpus)),
                     draw(st.integers(0, free.cpu_milli)),
                     draw(st.integers(0, free.memory_bytes)))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    names = [f"n{i}" for i in range(draw(st.integers(2, 6)))]
    capacity = {n: Resources(draw(st.sampled_from([4, 8])), draw(st.sampled_from([4, 8])),
                             draw(st.sampled_from([4, 8]))) for n in names}
    free = dict(capacity)
    running: list[Holding] = []
    actual: list[float] = []
    exact = draw(st.booleans())
    for i in range(draw(st.integers(0, 8))):
        node = draw(st.sampled_from(names))
        held = draw(resources_within(free[node]))
        if held == Resources():
            continue
        free[node] -= held
        end = float(draw(st.integers(1, 100)))
        running.append(Holding(f"r{i}", {node: held}, end))
        actual.append(end if exact else end * draw(st.floats(0.1, 1.0)))
    per_node = draw(resources_within(capacity[draw(st.sampled_from(names))]))
    large = sum(1 for c in capacity.values() if per_node.fits(c))
    gang = GangNeed(draw(st.integers(1, large)), per_node.gpus, per_node.cpu_milli,
                    per_node.memory_bytes)
    later = [Work(f"w{i}", draw(st.integers(1, 8)), draw(st.integers(1, 2)),
                  draw(st.one_of(st.none(), st.integers(1, 150).map(float))),
                  draw(st.integers(0, 8)), draw(st.integers(0, 8)))
             for i in range(draw(st.integers(0, 8)))]
    # Declared work runs at most its max duration; undeclared work may run very long.
    runs = [(w.max_duration if exact else w.max_duration * draw(st.floats(0.1, 1.0)))
            if w.max_duration is not None else float(draw(st.integers(1, 10_000)))
            for w in later]
    return capacity, running, actual, gang, later, runs


def free_at(t: float, capacity: Mapping[str, Resources],
            held: Sequence[Held]) -> dict[str, Resources]:
    """Free per node at ``t``: what ends at ``t`` has given its resources back."""
    free = dict(capacity)
    for resources, end in held:
        if end > t:
            for node, r in resources.items():
                free[node] -= r
    return free


def gang_start(capacity: Mapping[str, Resources], held: Sequence[Held], gang: GangNeed) -> float:
    """The first time enough nodes have the gang's whole per-node need free."""
    for t in sorted({0.0, *(end for _, end in held)}):
        free = free_at(t, capacity, held)
        if sum(1 for f in free.values() if gang.per_node.fits(f)) >= gang.nodes:
            return t
    return math.inf


@settings(max_examples=400, deadline=None)
@given(cases())
def test_backfill_never_delays_the_reserved_start(case: Case) -> None:
    capacity, running, actual, gang, later, runs = case
    plan = plan_backfill(0.0, capacity, running, gang, later)
    reservation = plan.reservation
    assert reservation is not None
    base = [(h.resources, end) for h, end in zip(running, actual, strict=True)]
    backfilled = [({node: w.per_node for node in plan.started[w.key]}, run)
                  for w, run in zip(later, runs, strict=True) if w.key in plan.started]
    everything = base + backfilled
    for t in {0.0, *(end for _, end in everything)}:   # no resource over-committed, ever
        assert all(Resources().fits(f) for f in free_at(t, capacity, everything).values())
    if math.isfinite(reservation.start):   # the gang fits on its nodes at its start
        free = free_at(reservation.start, capacity, everything)
        assert all(gang.per_node.fits(free[n]) for n in reservation.nodes)
    without = gang_start(capacity, base, gang)
    with_backfill = gang_start(capacity, everything, gang)
    assert without <= with_backfill <= reservation.start
    if all(h.end == end for h, end in zip(running, actual, strict=True)):
        # Exact estimates: the gang starts exactly when it would have without backfill.
        assert with_backfill == without == reservation.start
    for work in later:
        nodes = plan.started.get(work.key, ())
        if not reservation.nodes.isdisjoint(nodes):
            assert work.max_duration is not None and math.isfinite(reservation.start)
            assert work.max_duration <= reservation.start
