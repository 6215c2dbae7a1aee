"""Backfill (EASY-style): a blocked gang gets a reserved start on specific nodes; later,
smaller work may start now only where it cannot delay that start.

Pure planning over a small resource vector per node (``Resources``: whole GPUs, CPU
millicores, memory bytes), for the control plane and the simulator:

* ``reserve`` walks the expected ends of running work (start + declared max duration) in
  time order and finds the earliest time at which enough nodes have the gang's whole
  per-node vector free; it reserves those nodes (the ones freeing up last, so that nodes
  free now stay open to any work). Work without a declared end is assumed to run forever:
  a gang that needs its nodes gets ``start = inf`` and its reserved nodes take no backfill
  at all.
* ``may_start`` is the rule: work that touches no reserved node may start; work on a
  reserved node must declare a max duration and end by the reserved start.
* ``plan_backfill`` applies the rule to a queue with a simple best-fit placement (what the
  property tests simulate); a caller with a real scheduler uses ``allowed_nodes`` to
  restrict the candidates it offers to it.

Because reserved nodes only ever hold work that ends by the reserved start, and work on
other nodes does not touch them, the gang can start at the reserved time whatever was
backfilled — provided running work ends no later than it declared. A caller that has no
CPU or memory figures (a GPU-only trace) leaves them zero: they then never block anything.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Resources:
    """What the planner counts on a node: whole GPUs, CPU millicores and memory bytes."""

    gpus: int = 0
    cpu_milli: int = 0
    memory_bytes: int = 0

    def fits(self, within: Resources) -> bool:
        """Whether these resources fit in ``within``: no component is larger."""
        return (self.gpus <= within.gpus and self.cpu_milli <= within.cpu_milli
                and self.memory_bytes <= within.memory_bytes)

    def __add__(self, other: Resources) -> Resources:
        return Resources(self.gpus + other.gpus, self.cpu_milli + other.cpu_milli,
                         self.memory_bytes + other.memory_bytes)

    def __sub__(self, other: Resources) -> Resources:
        return Resources(self.gpus - other.gpus, self.cpu_milli - other.cpu_milli,
                         self.memory_bytes - other.memory_bytes)


@dataclass(frozen=True)
class Holding:
    """Running work: resources held per node, and its expected end (``None``: not declared)."""

    key: str
    resources: Mapping[str, Resources]
    end: float | None = None


@dataclass(frozen=True)
class GangNeed:
    """The blocked head of the queue: ``nodes`` nodes, each with ``gpus_per_node`` GPUs,
    ``cpu_milli`` and ``memory_bytes`` free (one member each)."""

    nodes: int
    gpus_per_node: int
    cpu_milli: int = 0
    memory_bytes: int = 0

    @property
    def per_node(self) -> Resources:
        return Resources(self.gpus_per_node, self.cpu_milli, self.memory_bytes)


@dataclass(frozen=True)
class Reservation:
    """When the gang is expected to start (``inf``: never, as far as is declared) and where."""

    start: float
    nodes: frozenset[str]


@dataclass(frozen=True)
class Work:
    """Later queued work: ``nodes`` nodes with ``gpus``, ``cpu_milli`` and ``memory_bytes``
    each (1 node: an ordinary pod)."""

    key: str
    gpus: int
    nodes: int = 1
    max_duration: float | None = None
    cpu_milli: int = 0
    memory_bytes: int = 0

    @property
    def per_node(self) -> Resources:
        return Resources(self.gpus, self.cpu_milli, self.memory_bytes)


@dataclass(frozen=True)
class BackfillPlan:
    """The reservation and the work that may start now, with the nodes it takes."""

    reservation: Reservation | None
    started: dict[str, tuple[str, ...]] = field(default_factory=dict)


#: A node's free resources while planning: [GPUs, CPU millicores, memory bytes]. A mutable
#: list, as the planner updates one per pod and per release: a fresh frozen ``Resources``
#: each time made ``reserve`` about four times slower on 10,000 nodes.
_Vector = list[int]
#: When declared work gives back what it holds on a node: (end, node, position of the work
#: in ``running``, what it holds there). The position breaks ties before the
#: ``Resources``, which have no order, would be compared.
_Release = tuple[float, str, int, Resources]


def _split(capacity: Mapping[str, Resources], running: Sequence[Holding]
           ) -> tuple[dict[str, _Vector], dict[str, _Vector], list[_Release]]:
    """Free resources per node now; what each node has left once all declared work has
    ended (capacity minus the work without a declared end); and the releases of the
    declared work (unsorted). One pass, the updates inlined: it runs once per pod."""
    free = {n: [total.gpus, total.cpu_milli, total.memory_bytes]
            for n, total in capacity.items()}
    left = {n: vector[:] for n, vector in free.items()}
    releases: list[_Release] = []
    for i, work in enumerate(running):
        end = work.end
        for node, held in work.resources.items():
            vector = free[node]
            vector[0] -= held.gpus
            vector[1] -= held.cpu_milli
            vector[2] -= held.memory_bytes
            if end is not None:
                releases.append((end, node, i, held))
                continue
            vector = left[node]
            vector[0] -= held.gpus
            vector[1] -= held.cpu_milli
            vector[2] -= held.memory_bytes
    return free, left, releases


def _take(vector: _Vector, held: Resources) -> None:
    vector[0] -= held.gpus
    vector[1] -= held.cpu_milli
    vector[2] -= held.memory_bytes


def _fitting(need: Resources, free: Mapping[str, _Vector], nodes: Iterable[str]) -> list[str]:
    """The nodes among ``nodes`` with ``need`` free (a comprehension, not a call per node:
    on 10,000 nodes the calls would cost more than the rest of the pass)."""
    gpus, cpu, memory = need.gpus, need.cpu_milli, need.memory_bytes
    return [n for n in nodes if (v := free[n])[0] >= gpus and v[1] >= cpu and v[2] >= memory]


def _large_enough(capacity: Mapping[str, Resources], need: Resources) -> list[str]:
    """The nodes whose whole capacity holds ``need`` (the others can never take it)."""
    gpus, cpu, memory = need.gpus, need.cpu_milli, need.memory_bytes
    return [n for n, total in capacity.items()
            if total.gpus >= gpus and total.cpu_milli >= cpu and total.memory_bytes >= memory]


def reserve(now: float, capacity: Mapping[str, Resources], running: Sequence[Holding],
            gang: GangNeed) -> Reservation | None:
    """The gang's earliest expected start and the nodes reserved for it (``None`` when the
    cluster has too few nodes large enough to ever hold it).

    Releases only ever add to a node's free resources, so a node is ready from the first
    release after which it has the gang's whole per-node need free, and stays ready; the
    nodes that are ever ready are those with the need left once all declared work has
    ended, so a gang that waits on undeclared work is known without walking the releases."""
    need = gang.per_node
    large = _large_enough(capacity, need)
    if len(large) < gang.nodes:
        return None
    free, left, releases = _split(capacity, running)
    eventually = _fitting(need, left, large)
    if len(eventually) < gang.nodes:
        return _never(large, eventually, left, gang)
    ready = dict.fromkeys(_fitting(need, free, eventually), now)
    waiting = set(eventually).difference(ready)  # only their releases can make a node ready
    _walk(now, [r for r in releases if r[1] in waiting], gang, free, ready)
    # Time is reached when the gang.nodes-th node is ready; nodes ready by then all qualify.
    start = sorted(ready.values())[gang.nodes - 1]
    eligible = [n for n, t in ready.items() if t <= start]
    chosen = sorted(eligible, key=lambda n: (-ready[n], n))[:gang.nodes]
    return Reservation(start, frozenset(chosen))


def _walk(now: float, releases: list[_Release], gang: GangNeed, free: dict[str, _Vector],
          ready: dict[str, float]) -> None:
    """Give back what declared work holds, in time order (then by node name: among nodes
    freeing at the same time, the first by name complete the gang), until ``gang.nodes``
    nodes are ready, recording in ``ready`` when each becomes so. ``releases`` is made a
    heap and consumed, not sorted: the walk usually stops long before the last release.
    The updates and the check are inlined: this loop may run once per running pod."""
    wanted, gpus, cpu, memory = gang.nodes, gang.gpus_per_node, gang.cpu_milli, gang.memory_bytes
    heapq.heapify(releases)
    while releases and len(ready) < wanted:
        end, node, _, held = heapq.heappop(releases)
        vector = free[node]
        vector[0] += held.gpus
        vector[1] += held.cpu_milli
        vector[2] += held.memory_bytes
        if node not in ready and vector[0] >= gpus and vector[1] >= cpu and vector[2] >= memory:
            ready[node] = max(end, now)


def _never(large: Sequence[str], eventually: Sequence[str], left: Mapping[str, _Vector],
           gang: GangNeed) -> Reservation:
    """The gang waits on work with no declared end: reserve the nodes that will be ready
    (``eventually``), then the ``large`` enough nodes with the most ``left`` once all
    declared work has ended (GPUs first, then CPU, then memory)."""
    ready = set(eventually)
    others = [n for n in large if n not in ready]
    others.sort(key=lambda n: (-left[n][0], -left[n][1], -left[n][2], n))
    return Reservation(math.inf, frozenset([*eventually, *others][:gang.nodes]))


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


def plan_backfill(now: float, capacity: Mapping[str, Resources], running: Sequence[Holding],
                  gang: GangNeed, later: Sequence[Work]) -> BackfillPlan:
    """Reserve the gang, then start what of ``later`` fits now without delaying it (queue
    order; each piece of work best-fit on the allowed nodes with the least free)."""
    reservation = reserve(now, capacity, running, gang)
    free = _split(capacity, running)[0]
    started: dict[str, tuple[str, ...]] = {}
    for work in later:
        nodes = _best_fit(work, allowed_nodes(work, free, now, reservation), free)
        if nodes is None or not may_start(work, nodes, now, reservation):
            continue
        need = work.per_node
        for node in nodes:
            _take(free[node], need)
        started[work.key] = nodes
    return BackfillPlan(reservation, started)


def _best_fit(work: Work, nodes: Sequence[str],
              free: Mapping[str, _Vector]) -> tuple[str, ...] | None:
    """The ``work.nodes`` nodes with room for it and the least free (GPUs first, then CPU,
    then memory: vectors compare in that order)."""
    need = work.per_node
    fitting = [(free[n], n) for n in _fitting(need, free, nodes)]
    if len(fitting) < work.nodes:
        return None
    return tuple(n for _, n in heapq.nsmallest(work.nodes, fitting))
