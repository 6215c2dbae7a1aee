"""Backfill (EASY-style): a blocked gang gets a reserved start on specific nodes; later,
smaller work may start now only where it cannot delay that start.

Pure planning over whole-GPU counts per node, for the control plane and the simulator:

* ``reserve`` walks the expected ends of running work (start + declared max duration) in
  time order and finds the earliest time at which enough nodes have the gang's GPUs free;
  it reserves those nodes (the ones freeing up last, so that nodes free now stay open
  to any work). Work without a declared end is assumed to run forever: a gang that needs
  its nodes gets ``start = inf`` and its reserved nodes take no backfill at all.
* ``may_start`` is the rule: work that touches no reserved node may start; work on a
  reserved node must declare a max duration and end by the reserved start.
* ``plan_backfill`` applies the rule to a queue with a simple best-fit placement (what the
  property tests simulate); a caller with a real scheduler uses ``allowed_nodes`` to
  restrict the candidates it offers to it.

Because reserved nodes only ever hold work that ends by the reserved start, and work on
other nodes does not touch them, the gang can start at the reserved time whatever was
backfilled — provided running work ends no later than it declared.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Holding:
    """Running work: GPUs held per node, and its expected end (``None``: not declared)."""

    key: str
    gpus: Mapping[str, int]
    end: float | None = None


@dataclass(frozen=True)
class GangNeed:
    """The blocked head of the queue: ``nodes`` nodes with ``gpus_per_node`` free each."""

    nodes: int
    gpus_per_node: int


@dataclass(frozen=True)
class Reservation:
    """When the gang is expected to start (``inf``: never, as far as is declared) and where."""

    start: float
    nodes: frozenset[str]


@dataclass(frozen=True)
class Work:
    """Later queued work: ``nodes`` nodes with ``gpus`` each (1 node: an ordinary pod)."""

    key: str
    gpus: int
    nodes: int = 1
    max_duration: float | None = None


@dataclass(frozen=True)
class BackfillPlan:
    """The reservation and the work that may start now, with the nodes it takes."""

    reservation: Reservation | None
    started: dict[str, tuple[str, ...]] = field(default_factory=dict)


def free_gpus(capacity: Mapping[str, int], running: Sequence[Holding]) -> dict[str, int]:
    """Free GPUs per node: capacity minus what running work holds."""
    free = dict(capacity)
    for work in running:
        for node, gpus in work.gpus.items():
            free[node] -= gpus
    return free


def reserve(now: float, capacity: Mapping[str, int], running: Sequence[Holding],
            gang: GangNeed) -> Reservation | None:
    """The gang's earliest expected start and the nodes reserved for it (``None`` when the
    cluster has too few nodes large enough to ever hold it)."""
    if sum(1 for total in capacity.values() if total >= gang.gpus_per_node) < gang.nodes:
        return None
    free = free_gpus(capacity, running)
    ready = {n: now for n, f in free.items() if f >= gang.gpus_per_node}
    for end, node, gpus in sorted(_releases(running)):
        if len(ready) >= gang.nodes:
            break
        free[node] += gpus
        if node not in ready and free[node] >= gang.gpus_per_node:
            ready[node] = max(end, now)
    if len(ready) < gang.nodes:
        return _never(capacity, ready, free, gang)
    # Time is reached when the gang.nodes-th node is ready; nodes ready by then all qualify.
    start = sorted(ready.values())[gang.nodes - 1]
    eligible = [n for n, t in ready.items() if t <= start]
    chosen = sorted(eligible, key=lambda n: (-ready[n], n))[:gang.nodes]
    return Reservation(start, frozenset(chosen))


def _releases(running: Sequence[Holding]) -> list[tuple[float, str, int]]:
    return [(work.end, node, gpus) for work in running if work.end is not None
            for node, gpus in work.gpus.items()]


def _never(capacity: Mapping[str, int], ready: Mapping[str, float],
           free: Mapping[str, int], gang: GangNeed) -> Reservation:
    """The gang waits on work with no declared end: reserve the nodes that will be ready,
    then the large-enough nodes with the most GPUs free once all declared work has ended."""
    others = [n for n, total in capacity.items() if total >= gang.gpus_per_node and n not in ready]
    others.sort(key=lambda n: (-free[n], n))
    return Reservation(math.inf, frozenset([*ready, *others][:gang.nodes]))


def may_start(work: Work, nodes: Collection[str], now: float,
              reservation: Reservation | None) -> bool:
    """Whether ``work`` may start now on ``nodes`` without delaying the reserved gang."""
    if reservation is None or reservation.nodes.isdisjoint(nodes):
        return True
    return ends_in_time(work, now, reservation)


def ends_in_time(work: Work, now: float, reservation: Reservation) -> bool:
    """Declared, and ends by the reserved start (a start of ``inf`` admits nothing: the
    reserved nodes are waiting on work whose end is unknown)."""
    return (work.max_duration is not None and math.isfinite(reservation.start)
            and now + work.max_duration <= reservation.start)


def allowed_nodes(work: Work, nodes: Collection[str], now: float,
                  reservation: Reservation | None) -> list[str]:
    """The nodes among ``nodes`` that ``work`` may be placed on now."""
    if reservation is None or ends_in_time(work, now, reservation):
        return list(nodes)
    return [n for n in nodes if n not in reservation.nodes]


def plan_backfill(now: float, capacity: Mapping[str, int], running: Sequence[Holding],
                  gang: GangNeed, later: Sequence[Work]) -> BackfillPlan:
    """Reserve the gang, then start what of ``later`` fits now without delaying it (queue
    order; each piece of work best-fit on the allowed nodes with the fewest free GPUs)."""
    reservation = reserve(now, capacity, running, gang)
    free = free_gpus(capacity, running)
    started: dict[str, tuple[str, ...]] = {}
    for work in later:
        nodes = _best_fit(work, allowed_nodes(work, free, now, reservation), free)
        if nodes is None or not may_start(work, nodes, now, reservation):
            continue
        for node in nodes:
            free[node] -= work.gpus
        started[work.key] = nodes
    return BackfillPlan(reservation, started)


def _best_fit(work: Work, nodes: Sequence[str], free: Mapping[str, int]) -> tuple[str, ...] | None:
    fitting = sorted((free[n], n) for n in nodes if free[n] >= work.gpus)
    if len(fitting) < work.nodes:
        return None
    return tuple(n for _, n in fitting[:work.nodes])
