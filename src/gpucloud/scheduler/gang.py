"""Gang placement: all members of a job on distinct nodes in one decision, or none.

``place_gang`` tries the topology domains from the tightest to the widest the job allows
(one ``block``, then one ``rack`` — node labels — then the whole cluster) and, inside a
domain, places the members one by one with the ordinary ``Scheduler`` on the domain's
nodes minus those already holding a member. The profile's filters and scores are thus
reused unchanged; only node exclusion between members is added here.

Members of one job ask for the same resources and are interchangeable, and a node holds at
most one of them, so a member fits a node regardless of where the others went: the greedy
pass succeeds whenever the domain has as many feasible nodes as the gang has members.
Nothing is reserved until every member has a node: a partial result is dropped.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from gpucloud.core.jobs import Topology
from gpucloud.scheduler.scheduler import Scheduler
from gpucloud.scheduler.types import Explanation, NodeState, Placement, PodRequest

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


@dataclass(frozen=True)
class GangDecision:
    """One placement per member (by rank), or a summary and per-reason node counts."""

    placements: tuple[Placement, ...] | None
    domain: str | None
    summary: str
    explanation: Explanation | None = None


@dataclass(frozen=True)
class _Attempt:
    placements: list[Placement]
    failure: Explanation | None


def place_gang(scheduler: Scheduler, nodes: Sequence[NodeState],
               members: Sequence[PodRequest], topology: Topology) -> GangDecision:
    """Place every member on its own node, within ``topology``; never a partial result."""
    if not members:
        return GangDecision((), "cluster", "nothing to place")
    best: tuple[int, str] = (0, "")
    for keys in LEVELS[topology]:
        for where, domain in _domains(nodes, keys):
            attempt = _place_in(scheduler, domain, members)
            if attempt.failure is None:
                return GangDecision(tuple(attempt.placements), where, f"placed in {where}")
            best = max(best, (len(attempt.placements), where))
    return _explain(scheduler, nodes, members, topology, best)


def _domains(nodes: Sequence[NodeState],
             keys: tuple[str, ...]) -> list[tuple[str, list[NodeState]]]:
    """Nodes grouped by their values of the label ``keys``, smallest group first (a
    best-fit order that keeps large groups for large gangs); a node missing one of the
    labels is in no group."""
    if not keys:
        return [("the cluster", list(nodes))]
    groups: dict[str, list[NodeState]] = defaultdict(list)
    for node in nodes:
        values = [node.labels.get(key) for key in keys]
        if all(values):
            groups[" ".join(f"{k} {v}" for k, v in zip(keys, values, strict=True))].append(node)
    return sorted(groups.items(), key=lambda item: (len(item[1]), item[0]))


def _place_in(scheduler: Scheduler, nodes: Sequence[NodeState],
              members: Sequence[PodRequest]) -> _Attempt:
    """Greedy, member by member, each on a node no earlier member took."""
    remaining = list(nodes)
    placements: list[Placement] = []
    for member in members:
        if not remaining:
            return _Attempt(placements, Explanation({}))
        decision = scheduler.schedule(remaining, [member])[0]
        if decision.placement is None:
            return _Attempt(placements, decision.explanation or Explanation({}))
        placements.append(decision.placement)
        taken = decision.placement.node
        remaining = [node for node in remaining if node.name != taken]
    return _Attempt(placements, None)


def _explain(scheduler: Scheduler, nodes: Sequence[NodeState], members: Sequence[PodRequest],
             topology: Topology, best: tuple[int, str]) -> GangDecision:
    """Why no domain fits: how many nodes could take a member, and why the others cannot."""
    wanted = len(members)
    whole = _place_in(scheduler, nodes, members)
    fit = len(whole.placements)
    reasons = dict(whole.failure.reasons) if whole.failure else {}
    if fit:
        reasons[FITS_A_MEMBER] = fit
    explanation = Explanation(reasons)
    gpus = members[0].gpus
    need = f"needs {wanted} nodes with {gpus} free GPU{'' if gpus == 1 else 's'} each"
    if fit < wanted:
        summary = f"{need}, {fit} {'has' if fit == 1 else 'have'} them"
    else:
        level = {Topology.SAME_BLOCK: "block", Topology.SAME_RACK: "rack"}.get(topology, "domain")
        summary = (f"{need} in one {level} ({topology}); at most {best[0]} fit in one {level}"
                   + (f" ({best[1]})" if best[1] else ""))
    others = {k: v for k, v in reasons.items() if k != FITS_A_MEMBER}
    if others:
        summary += "; " + Explanation(others).summary()
    return GangDecision(None, None, summary, explanation)


def apply_placements(nodes: Sequence[NodeState], members: Sequence[PodRequest],
                     placements: Sequence[Placement]) -> list[NodeState]:
    """The snapshot after the placements: later decisions of a pass must see them."""
    by_node = {p.node: (m, p) for m, p in zip(members, placements, strict=True)}
    return [_take(node, *by_node[node.name]) if node.name in by_node else node
            for node in nodes]


def _take(node: NodeState, member: PodRequest, placement: Placement) -> NodeState:
    gpus = tuple(
        replace(gpu, used_milli=gpu.used_milli + placement.gpu_milli.get(gpu.index, 0))
        if gpu.index in placement.gpu_milli else gpu
        for gpu in node.gpus
    )
    return replace(node, gpus=gpus, cpu_used_milli=node.cpu_used_milli + member.cpu_milli,
                   memory_used_bytes=node.memory_used_bytes + member.memory_bytes)
