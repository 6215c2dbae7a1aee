"""Preemption: which running work to stop so that a pending pod or gang fits.

``plan_preemption`` takes the cluster snapshot, the running work (``Running``: a pod, or a
whole gang, with its priority, project, start time and where its members run) and a
``Preemptor`` that fits nowhere as things are. It returns the victims and the placements
the preemptor gets once they are gone, or None.

The rules:

- a victim has strictly lower priority than the preemptor — with one exception, reclaim:
  a preemptor asking for GPUs within its project's quota (``Preemptor.reclaiming``) may
  also take another project's work of *equal* priority that runs on borrowed capacity, as
  long as that project keeps at least its quota. Borrowed work thus ranks just below
  in-quota work of its class (as in Kueue), so a quota is guaranteed against borrowers of
  the same class even when everything runs at the default class. Work of higher priority
  is never a victim;
- a gang is a victim whole or not at all (``Running`` is the unit);
- a preemptor that would borrow (run beyond its project's quota) never takes work that is
  within another project's quota (``quota.Ledger.protected``);
- among the ways to make room: the fewest victim pods, then the lowest highest victim
  priority, then the least GPU-time lost (GPUs x seconds run so far).

For each node the victims are chosen greedily (lowest priority, least GPU-time first) until
the preemptor fits, then each is given a reprieve if it can stay — the Kubernetes approach.
A gang takes the cheapest N nodes of one topology domain; whatever the per-node choice,
the result is verified by placing the preemptor on the snapshot without its victims.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpucloud.core.jobs import Topology
from gpucloud.scheduler.gang import LEVELS, place_gang
from gpucloud.scheduler.mig import geometry
from gpucloud.scheduler.quota import Ledger
from gpucloud.scheduler.scheduler import Scheduler
from gpucloud.scheduler.types import NodeState, Placement, PodRequest


@dataclass(frozen=True)
class Member:
    """One pod of running work: its node and what it holds there."""

    node: str
    gpu_milli: Mapping[int, int]
    cpu_milli: int = 0
    memory_bytes: int = 0
    #: A MIG pod's instance (GPU index -> (profile, start slot)) and a share's device
    #: memory limit: what its preemption frees besides the milli.
    mig: Mapping[int, tuple[str, int]] = field(default_factory=dict)
    gpu_memory_mib: int = 0


@dataclass(frozen=True)
class Running:
    """Running work that may be preempted as one unit: a pod, or every member of a gang."""

    key: str
    priority: int
    project: str
    started: float
    members: tuple[Member, ...]

    def gpu_time_lost(self, now: float) -> float:
        milli = sum(sum(m.gpu_milli.values()) for m in self.members)
        return milli * max(0.0, now - self.started)


@dataclass(frozen=True)
class Preemptor:
    """Pending work that fits nowhere: one request per member (one for a pod).

    ``borrowing``: it would run beyond its project's quota. ``reclaiming``: it asks for
    GPUs within its project's quota, so it may take back other projects' borrowed work of
    its own priority.
    """

    key: str
    priority: int
    project: str
    members: tuple[PodRequest, ...]
    topology: Topology = Topology.ANY
    borrowing: bool = False
    reclaiming: bool = False


@dataclass(frozen=True)
class PreemptionPlan:
    """``reclaimed``: the keys of the victims taken back as borrowed work (equal priority)."""

    victims: tuple[Running, ...]
    placements: tuple[Placement, ...]
    reclaimed: frozenset[str] = frozenset()

    @property
    def victim_pods(self) -> int:
        return sum(len(v.members) for v in self.victims)


@dataclass
class _Choice:
    victims: list[Running]
    cost: tuple[int, int, float] = field(default=(0, 0, 0.0))


def plan_preemption(scheduler: Scheduler, nodes: Sequence[NodeState],
                    running: Sequence[Running], preemptor: Preemptor, ledger: Ledger,
                    now: float) -> PreemptionPlan | None:
    """The cheapest set of victims that lets ``preemptor`` fit, and its placements."""
    if not preemptor.members:
        return None
    candidates = sorted(
        (r for r in running if r.priority < preemptor.priority or _reclaimable(r, preemptor)),
        key=lambda r: (r.priority, r.gpu_time_lost(now), r.key))
    if not candidates:
        return None
    models = gpu_models(nodes)
    on_node: dict[str, list[Running]] = defaultdict(list)
    for unit in candidates:
        for name in {m.node for m in unit.members}:
            on_node[name].append(unit)
    choices = {node.name: choice for node in nodes
               if (choice := _node_choice(scheduler, node, on_node.get(node.name, []),
                                          preemptor, ledger, models, now)) is not None}
    if len(preemptor.members) == 1:
        found = _single(scheduler, nodes, choices, preemptor)
    else:
        found = _gang(scheduler, nodes, choices, preemptor, _Context(ledger, models, now))
    if found is None:
        return None
    return replace(found, reclaimed=frozenset(
        v.key for v in found.victims if _taken_back(v, preemptor)))


def _taken_back(victim: Running, preemptor: Preemptor) -> bool:
    """A victim not of lower priority can only be reclaimed borrowed work."""
    return victim.priority >= preemptor.priority


def _reclaimable(unit: Running, preemptor: Preemptor) -> bool:
    """Whether ``unit`` is a reclaim candidate: another project's GPU work of the
    preemptor's own priority, the preemptor within its quota (``_may_take`` then checks
    that the work is borrowed)."""
    return (preemptor.reclaiming and unit.priority == preemptor.priority
            and unit.project != preemptor.project
            and any(m.gpu_milli for m in unit.members))


def gpu_models(nodes: Sequence[NodeState]) -> dict[tuple[str, int], str]:
    """The model of every GPU, by (node name, GPU index)."""
    return {(node.name, gpu.index): gpu.model for node in nodes for gpu in node.gpus}


def _node_choice(scheduler: Scheduler, node: NodeState, units: list[Running],
                 preemptor: Preemptor, ledger: Ledger, models: dict[tuple[str, int], str],
                 now: float) -> _Choice | None:
    """The victims on ``node`` that make room for one member, or None if none do.

    Greedy twice — lowest priority first, and largest first (fewer victims when one big
    pod frees what several small ones would) — each followed by reprieves; the cheaper wins.
    """
    if _fits(scheduler, node, preemptor.members[0]):
        return _Choice([])
    largest = sorted(units, key=lambda u: -sum(sum(m.gpu_milli.values())
                                               for m in u.members if m.node == node.name))
    found = [victims for order in (units, largest)
             if (victims := _greedy(scheduler, node, order, preemptor, ledger, models))]
    if not found:
        return None
    best = min(found, key=lambda victims: _cost(victims, now))
    return _Choice(best, _cost(best, now))


def _greedy(scheduler: Scheduler, node: NodeState, order: list[Running],
            preemptor: Preemptor, ledger: Ledger,
            models: dict[tuple[str, int], str]) -> list[Running] | None:
    request = preemptor.members[0]
    victims: list[Running] = []
    for unit in order:
        if not _may_take(victims + [unit], preemptor, ledger, models):
            continue
        victims.append(unit)
        if _fits(scheduler, _without(node, victims), request):
            break
    else:
        return None
    for unit in reversed(list(victims)):
        kept = [v for v in victims if v is not unit]
        if _fits(scheduler, _without(node, kept), request):
            victims = kept
    return victims


def _cost(victims: Sequence[Running], now: float) -> tuple[int, int, float]:
    return (sum(len(v.members) for v in victims), max((v.priority for v in victims), default=-1),
            sum(v.gpu_time_lost(now) for v in victims))


def _may_take(victims: Sequence[Running], preemptor: Preemptor, ledger: Ledger,
              models: dict[tuple[str, int], str]) -> bool:
    """Whether the victims leave every other project at least at its quota, where that
    must hold: always for a borrowing preemptor, and for each project whose work of equal
    priority is reclaimed (only what it borrowed may be taken back)."""
    reclaimed = {u.project for u in victims if _taken_back(u, preemptor)}
    if not preemptor.borrowing and not reclaimed:
        return True
    taken: dict[tuple[str, str], int] = defaultdict(int)
    for unit in victims:
        if unit.project == preemptor.project:
            continue
        for member in unit.members:
            for index, milli in member.gpu_milli.items():
                taken[unit.project, models.get((member.node, index), "")] += milli
    return not any(ledger.protected(project, model, milli)
                   for (project, model), milli in taken.items()
                   if preemptor.borrowing or project in reclaimed)


def _fits(scheduler: Scheduler, node: NodeState, request: PodRequest) -> bool:
    return scheduler.schedule([node], [request])[0].placement is not None


def _without(node: NodeState, victims: Sequence[Running]) -> NodeState:
    """``node`` with the victims' members on it gone."""
    freed: dict[int, int] = defaultdict(int)
    slices: dict[int, set[int]] = defaultdict(set)
    gpu_memory: dict[int, int] = defaultdict(int)
    models = {g.index: g.model for g in node.gpus}
    cpu = memory = 0
    for unit in victims:
        for member in unit.members:
            if member.node != node.name:
                continue
            for index, milli in member.gpu_milli.items():
                freed[index] += milli
                gpu_memory[index] += member.gpu_memory_mib
            for index, (profile, slot) in member.mig.items():
                slices[index] |= _slices(models.get(index, ""), profile, slot)
            cpu += member.cpu_milli
            memory += member.memory_bytes
    gpus = tuple(replace(g, used_milli=max(0, g.used_milli - freed[g.index]),
                         mig_used=tuple(s for s in g.mig_used if s not in slices[g.index]),
                         memory_used_mib=max(0, g.memory_used_mib - gpu_memory[g.index]))
                 if freed[g.index] or slices[g.index] else g for g in node.gpus)
    return replace(node, gpus=gpus, cpu_used_milli=max(0, node.cpu_used_milli - cpu),
                   memory_used_bytes=max(0, node.memory_used_bytes - memory))


def _slices(model: str, profile: str, slot: int) -> set[int]:
    """The memory slices a MIG instance of ``profile`` at ``slot`` takes on ``model``."""
    geom = geometry(model, profile)
    return set(range(slot, slot + geom.size)) if geom is not None else set()


def without_victims(nodes: Sequence[NodeState],
                    victims: Sequence[Running]) -> list[NodeState]:
    """The snapshot once the victims (every member, on every node) are gone."""
    touched = {m.node for v in victims for m in v.members}
    return [_without(node, victims) if node.name in touched else node for node in nodes]


def _single(scheduler: Scheduler, nodes: Sequence[NodeState], choices: dict[str, _Choice],
            preemptor: Preemptor) -> PreemptionPlan | None:
    by_name = {node.name: node for node in nodes}
    for name, choice in sorted(choices.items(), key=lambda item: (item[1].cost, item[0])):
        if not choice.victims:
            continue
        node = without_victims([by_name[name]], choice.victims)[0]
        decision = scheduler.schedule([node], list(preemptor.members))[0]
        if decision.placement is not None:
            return PreemptionPlan(tuple(choice.victims), (decision.placement,))
    return None


@dataclass(frozen=True)
class _Context:
    ledger: Ledger
    models: dict[tuple[str, int], str]
    now: float


def _gang(scheduler: Scheduler, nodes: Sequence[NodeState], choices: dict[str, _Choice],
          preemptor: Preemptor, context: _Context) -> PreemptionPlan | None:
    """The cheapest N nodes of each domain the topology allows; the cheapest verified."""
    wanted = len(preemptor.members)
    options: list[tuple[tuple[int, int, float], int, list[Running]]] = []
    for level, keys in enumerate(LEVELS[preemptor.topology]):
        for domain in _domains(nodes, keys):
            picked = sorted((choices[n.name].cost, n.name) for n in domain
                            if n.name in choices)[:wanted]
            if len(picked) < wanted:
                continue
            victims = _union(choices[name].victims for _, name in picked)
            if victims and _may_take(victims, preemptor, context.ledger, context.models):
                options.append((_cost(victims, context.now), level, victims))
    for _, _, victims in sorted(options, key=lambda o: (o[0], o[1])):
        decision = place_gang(scheduler, without_victims(nodes, victims),
                              list(preemptor.members), preemptor.topology)
        if decision.placements is not None:
            return PreemptionPlan(tuple(victims), decision.placements)
    return None


def _union(groups: Iterable[Sequence[Running]]) -> list[Running]:
    seen: dict[str, Running] = {}
    for group in groups:
        for unit in group:
            seen.setdefault(unit.key, unit)
    return list(seen.values())


def _domains(nodes: Sequence[NodeState], keys: tuple[str, ...]) -> list[list[NodeState]]:
    """Nodes grouped by their values of the label ``keys`` (none: the whole cluster)."""
    if not keys:
        return [list(nodes)]
    groups: dict[tuple[str, ...], list[NodeState]] = defaultdict(list)
    for node in nodes:
        values = tuple(node.labels.get(key, "") for key in keys)
        if all(values):
            groups[values].append(node)
    return list(groups.values())


def with_placements(nodes: Sequence[NodeState], requests: Sequence[PodRequest],
                    placements: Sequence[Placement]) -> list[NodeState]:
    """The snapshot after the placements (any number per node): later plans see them."""
    taken: dict[str, list[tuple[PodRequest, Placement]]] = defaultdict(list)
    for request, placement in zip(requests, placements, strict=True):
        taken[placement.node].append((request, placement))
    return [_with(node, taken[node.name]) if node.name in taken else node for node in nodes]


def _with(node: NodeState, taken: list[tuple[PodRequest, Placement]]) -> NodeState:
    used: dict[int, int] = defaultdict(int)
    slices: dict[int, set[int]] = defaultdict(set)
    gpu_memory: dict[int, int] = defaultdict(int)
    models = {g.index: g.model for g in node.gpus}
    for request, placement in taken:
        for index, milli in placement.gpu_milli.items():
            used[index] += milli
            gpu_memory[index] += request.gpu_memory_mib
        for index, (profile, slot) in placement.mig.items():
            slices[index] |= _slices(models.get(index, ""), profile, slot)
    gpus = tuple(replace(g, used_milli=min(1000, g.used_milli + used[g.index]),
                         mig_used=tuple(sorted(set(g.mig_used) | slices[g.index])),
                         memory_used_mib=g.memory_used_mib + gpu_memory[g.index])
                 if used[g.index] or slices[g.index] else g for g in node.gpus)
    return replace(node, gpus=gpus,
                   cpu_used_milli=node.cpu_used_milli + sum(r.cpu_milli for r, _ in taken),
                   memory_used_bytes=node.memory_used_bytes
                   + sum(r.memory_bytes for r, _ in taken))
