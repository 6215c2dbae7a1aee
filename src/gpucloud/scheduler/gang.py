"""Gang placement: all members of a job on distinct nodes in one decision, or none.

``place_gang`` tries the topology domains from the tightest to the widest the job allows
(one ``block``, then one ``rack`` — node labels — then the whole cluster). Members of one
job ask for the same resources and are interchangeable, and a node holds at most one of
them, so a member fits a node regardless of where the others went: a domain can take the
gang exactly when it has as many feasible nodes as the gang has members.

That makes placement cheap on a large cluster:

1. **Feasibility first, lazily, per domain.** Nodes are grouped by label (no GPU is looked
   at); domains smaller than the gang are skipped, and only the nodes of the candidate
   domains, tightest first, are checked against a cheap necessary condition
   (``_may_take``: condition, labels, CPU, memory, free GPU capacity). The first domain
   with enough such nodes is the one to try; usually few nodes are ever examined.
2. **Score only within it.** The profile's own filters, scores and reserve (the ordinary
   ``Framework``) run on that domain's feasible nodes only — a bounded random sample of
   them when there are many (Nomad-style bounded scoring, as the ``default`` profile does
   for single pods) — placing members one by one, each on a node no earlier member took.
   The filters there are the real ones: a node that passed the cheap check but fails them
   (e.g. wrong GPU model) is skipped, and a domain that then falls short is abandoned for
   the next one.

Nothing is reserved until every member has a node: a partial result is dropped.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from gpucloud.core.gpu_models import canonical_name
from gpucloud.core.jobs import Topology
from gpucloud.scheduler.framework.cluster import ClusterState
from gpucloud.scheduler.mig import MIG_SLOTS, geometry
from gpucloud.scheduler.scheduler import Scheduler, to_placement
from gpucloud.scheduler.types import (
    FULL_GPU_MILLI,
    Explanation,
    GpuState,
    NodeState,
    Placement,
    PodRequest,
)

#: The domains to try, tightest first, as the node labels their nodes must share (none:
#: the whole cluster). A block is tighter than a rack; under ``same-rack`` a block's nodes
#: are grouped by rack too, so a placement never breaks the constraint however blocks and
#: racks nest.
LEVELS: dict[Topology, tuple[tuple[str, ...], ...]] = {
    Topology.SAME_BLOCK: (("block",),),
    Topology.SAME_RACK: (("block", "rack"), ("rack",)),
    Topology.ANY: (("block",), ("rack",), ()),
}
#: The reason counted for nodes that could take a member but are too few (or too spread).
FITS_A_MEMBER = "free for a member"
#: Feasible nodes scored per domain: the members plus this share of slack (at least
#: ``MIN_SLACK`` nodes).
SLACK_SHARE = 4
MIN_SLACK = 32


@dataclass(frozen=True)
class GangDecision:
    """One placement per member (by rank), or a summary and per-reason node counts."""

    placements: tuple[Placement, ...] | None
    domain: str | None
    summary: str
    explanation: Explanation | None = None


@dataclass
class _Search:
    """Per-call memo of the cheap feasibility check, by node position."""

    nodes: Sequence[NodeState]
    member: PodRequest
    checked: dict[int, bool] = field(default_factory=dict)

    def feasible(self, positions: Sequence[int], wanted: int) -> list[int]:
        """The feasible nodes of a domain, or — in a domain much larger than the gang — a
        random sample of them: nodes are checked in a fixed-seed random order until
        ``_sample_size(wanted)`` pass, so a large idle cluster costs a few hundred checks,
        not one per node."""
        limit = _sample_size(wanted)
        order: Sequence[int] = positions
        if len(positions) > limit:
            rng = np.random.default_rng(len(positions))
            order = [positions[int(i)] for i in rng.permutation(len(positions))]
        out: list[int] = []
        for i in order:
            ok = self.checked.get(i)
            if ok is None:
                ok = self.checked[i] = _may_take(self.nodes[i], self.member)
            if ok:
                out.append(i)
                if len(out) == limit:
                    break
        return sorted(out)


def _sample_size(wanted: int) -> int:
    """Feasible nodes scored per domain: the members plus some slack, so that the profile's
    scores choose among more nodes than the gang needs (Nomad-style bounded scoring)."""
    return wanted + max(MIN_SLACK, wanted // SLACK_SHARE)


def place_gang(scheduler: Scheduler, nodes: Sequence[NodeState],
               members: Sequence[PodRequest], topology: Topology) -> GangDecision:
    """Place every member on its own node, within ``topology``; never a partial result."""
    if not members:
        return GangDecision((), "cluster", "nothing to place")
    search = _Search(nodes, members[0])
    wanted = len(members)
    for keys in LEVELS[topology]:
        for where, positions in _domains(nodes, keys):
            if len(positions) < wanted:
                continue
            feasible = search.feasible(positions, wanted)
            placements = _place_in(scheduler, nodes, feasible, members) \
                if len(feasible) >= wanted else None
            if placements is not None:
                return GangDecision(placements, where, f"placed in {where}")
    return _explain(scheduler, nodes, members, topology)


def _domains(nodes: Sequence[NodeState], keys: tuple[str, ...]) -> list[tuple[str, list[int]]]:
    """Node positions grouped by their values of the label ``keys``, smallest group first
    (a best-fit order that keeps large groups for large gangs); a node missing one of the
    labels is in no group."""
    if not keys:
        return [("the cluster", list(range(len(nodes))))]
    groups: dict[tuple[str | None, ...], list[int]] = defaultdict(list)
    if len(keys) == 1:  # the common case, kept to one dict lookup per node
        key = keys[0]
        single: dict[str | None, list[int]] = defaultdict(list)
        for i, node in enumerate(nodes):
            single[node.labels.get(key)].append(i)
        groups.update(((value,), members) for value, members in single.items())
    else:
        for i, node in enumerate(nodes):
            groups[tuple(node.labels.get(k) for k in keys)].append(i)
    named = [(" ".join(f"{k} {v}" for k, v in zip(keys, values, strict=True)), members)
             for values, members in groups.items() if all(values)]
    return sorted(named, key=lambda item: (len(item[1]), item[0]))


def _may_take(node: NodeState, member: PodRequest) -> bool:
    """A necessary condition for ``member`` to fit ``node`` (the profile's filters decide).

    It never rejects a node the filters would accept: it checks only condition, selector,
    CPU, memory and free GPU capacity, ignoring GPU model and memory constraints.
    """
    if node.cordoned or not node.ready:
        return False
    if node.cpu_milli - node.cpu_used_milli < member.cpu_milli:
        return False
    if node.memory_bytes - node.memory_used_bytes < member.memory_bytes:
        return False
    if any(node.labels.get(k) != v for k, v in member.node_selector.items()):
        return False
    if member.gpus:
        return _full_free(node.gpus) >= member.gpus
    if member.gpu_milli:
        return any(_free_milli(gpu) >= member.gpu_milli for gpu in node.gpus)
    return bool(node.gpus) or member.mig_profile is None


def _full_free(gpus: Sequence[GpuState]) -> int:
    """Entirely free GPUs (as ``ClusterState`` counts them); the hot loop of the scan."""
    return sum(1 for gpu in gpus if gpu.used_milli <= 0 and not gpu.mig_used)


def _free_milli(gpu: GpuState) -> int:
    """Free share of a GPU as ``ClusterState`` counts it (a GPU running MIG has none)."""
    if gpu.mig_used:
        return 0
    return FULL_GPU_MILLI - min(max(gpu.used_milli, 0), FULL_GPU_MILLI)


def _place_in(scheduler: Scheduler, nodes: Sequence[NodeState], feasible: list[int],
              members: Sequence[PodRequest]) -> tuple[Placement, ...] | None:
    """Members one by one with the profile's plugins on ``feasible`` (sorted, so that ties
    still go to the earliest node)."""
    state = ClusterState.from_nodes([nodes[i] for i in feasible])
    framework = scheduler.framework(state, members)
    placements: list[Placement] = []
    for member in members:
        outcome = framework.schedule(member)
        if outcome.allocation is None:
            return None
        placements.append(to_placement(member, outcome.allocation, state))
        # This working copy is ours: marking the node cordoned keeps later members off it.
        state.cordoned[outcome.allocation.node] = True
    return tuple(placements)


def _explain(scheduler: Scheduler, nodes: Sequence[NodeState], members: Sequence[PodRequest],
             topology: Topology) -> GangDecision:
    """Why no domain fits: how many nodes could take a member, and why the others cannot."""
    wanted = len(members)
    reasons, fitting = _reasons(scheduler, nodes, members[0])
    fit = len(fitting)
    if fit:
        reasons[FITS_A_MEMBER] = fit
    gpus = members[0].gpus
    need = f"needs {wanted} nodes with {gpus} free GPU{'' if gpus == 1 else 's'} each"
    if members[0].mig_profile:
        need = f"needs {wanted} nodes with a free {members[0].mig_profile} MIG slot each"
    if fit < wanted:
        summary = f"{need}, {fit} {'has' if fit == 1 else 'have'} them"
    else:
        count, where = _widest(nodes, topology, set(fitting))
        level = {Topology.SAME_BLOCK: "block", Topology.SAME_RACK: "rack"}.get(topology, "domain")
        summary = (f"{need} in one {level} ({topology}); at most {count} fit in one {level}"
                   + (f" ({where})" if where else ""))
    others = {k: v for k, v in reasons.items() if k != FITS_A_MEMBER}
    if others:
        summary += "; " + Explanation(others).summary()
    return GangDecision(None, None, summary, Explanation(reasons))


def _reasons(scheduler: Scheduler, nodes: Sequence[NodeState],
             member: PodRequest) -> tuple[dict[str, int], list[int]]:
    """The profile's filters over the whole cluster, once: per reason the nodes whose first
    failing filter gave it, and the nodes that pass them all."""
    state = ClusterState.from_nodes(nodes)
    framework = scheduler.framework(state, [member])
    cycle = framework.new_cycle(member)
    everyone = np.arange(len(nodes), dtype=np.int64)
    remaining = np.ones(len(nodes), np.bool_)
    reasons: dict[str, int] = {}
    for plugin in framework.profile.filters:
        for reason, rejected in plugin.filter(cycle, state, everyone):
            hit = remaining & rejected
            if hit.any():
                reasons[reason] = reasons.get(reason, 0) + int(hit.sum())
                remaining &= ~hit
    return reasons, [int(i) for i in np.flatnonzero(remaining)]


def _widest(nodes: Sequence[NodeState], topology: Topology,
            fitting: set[int]) -> tuple[int, str]:
    """The most fitting nodes any one allowed domain (other than the cluster) holds."""
    best = (0, "")
    for keys in LEVELS[topology]:
        if keys:
            for where, positions in _domains(nodes, keys):
                best = max(best, (sum(1 for i in positions if i in fitting), where))
    return best


def apply_placements(nodes: Sequence[NodeState], members: Sequence[PodRequest],
                     placements: Sequence[Placement]) -> list[NodeState]:
    """The snapshot after the placements: later decisions of a pass must see them."""
    by_node = {p.node: (m, p) for m, p in zip(members, placements, strict=True)}
    return [_take(node, *by_node[node.name]) if node.name in by_node else node
            for node in nodes]


def _take(node: NodeState, member: PodRequest, placement: Placement) -> NodeState:
    gpus = tuple(_take_gpu(gpu, member, placement) if gpu.index in placement.gpu_milli
                 else gpu for gpu in node.gpus)
    return replace(node, gpus=gpus, cpu_used_milli=node.cpu_used_milli + member.cpu_milli,
                   memory_used_bytes=node.memory_used_bytes + member.memory_bytes)


def _take_gpu(gpu: GpuState, member: PodRequest, placement: Placement) -> GpuState:
    """One GPU after a member's placement: its share or whole GPU, or its MIG slices."""
    found = placement.mig.get(gpu.index)
    if found is not None:
        profile, start = found
        geom = geometry(canonical_name(gpu.model), profile)
        size = geom.size if geom is not None else MIG_SLOTS
        slots = set(gpu.mig_used) | set(range(start, min(MIG_SLOTS, start + size)))
        return replace(gpu, mig_used=tuple(sorted(slots)))
    memory = member.gpu_memory_mib if member.gpu_milli else 0
    return replace(gpu, used_milli=gpu.used_milli + placement.gpu_milli.get(gpu.index, 0),
                   memory_used_mib=gpu.memory_used_mib + memory)
