"""Per pod shape, every node's filter verdict and raw scores, kept up to date by version.

A backlog is mostly pods of a few shapes (the same request but for the key). For such a
pod the filters and scores of a node depend only on the request and on that node's row
of the state, which changes only through a placement (``ClusterState.commit``, or a
release that bumps the node's version the same way). So, from the second pod of a shape
on, the framework keeps for that shape one table over all nodes: whether each passes
every filter, and each score plugin's raw score. A pod then reads its candidates' rows
(a gather) instead of running every plugin on them, and the rows of nodes changed since
the table was last brought up to date are recomputed, in one batch, only when a pod's
candidates include one of them.

This holds only for plugins that declare ``node_local = True``: a plugin whose verdict
on a node depends on nothing but the pod's request and that node's row (not on the other
candidates, nor on a random draw, nor on data replaced outside a commit). A profile with
any other filter or score plugin never uses tables. The results are the very numbers the
plugins give (``tests/unit/scheduler/test_shape_tables.py`` checks decisions against the
plain path).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, fields
from operator import attrgetter

import numpy as np

from gpucloud.scheduler.framework.cluster import BoolArray, ClusterState, FloatArray, IntArray
from gpucloud.scheduler.framework.plugin import Cycle
from gpucloud.scheduler.framework.registry import Profile
from gpucloud.scheduler.types import PodRequest

#: Every field of a request but its key: two requests equal on these are one shape.
_SHAPE_FIELDS = tuple(f.name for f in fields(PodRequest) if f.name != "key")
_SHAPE_OF = attrgetter(*_SHAPE_FIELDS)
#: The positions of the mapping fields (``node_selector``), made hashable as sorted items.
_MAPPINGS = tuple(i for i, f in enumerate(f for f in fields(PodRequest) if f.name != "key")
                  if f.default_factory is dict)


def shape_key(pod: PodRequest) -> tuple[Hashable, ...]:
    """The pod's request without its key (mappings as sorted items, to be hashable)."""
    values = list(_SHAPE_OF(pod))
    for i in _MAPPINGS:
        values[i] = tuple(sorted(values[i].items()))
    return tuple(values)


def node_local(profile: Profile) -> bool:
    """Whether every filter and score plugin of ``profile`` is node-local (see above)."""
    plugins = [*profile.filters, *(plugin for plugin, _ in profile.scores)]
    return all(getattr(plugin, "node_local", False) is True for plugin in plugins)


@dataclass
class ShapeTable:
    """One shape's rows: ``ok`` (passes every filter) and ``raw`` (per score plugin), each
    over all nodes, as of ``seen`` (the state's version when last brought up to date)."""

    ok: BoolArray
    raw: list[FloatArray]
    seen: int
    #: Per score plugin, its one finite value on every node, else None (a plugin that
    #: cannot tell this shape's candidates apart, as Topology for one GPU: min-max
    #: normalised it adds zero, so the framework skips it).
    constant: list[float | None]

    def refreshed(self, scorer: int, values: FloatArray) -> None:
        """Forget ``scorer``'s constant once new rows differ from it."""
        value = self.constant[scorer]
        if value is not None and values.size and not bool((values == value).all()):
            self.constant[scorer] = None


class ShapeTables:
    """The tables of one framework's pods, built from a shape's second pod on."""

    def __init__(self, profile: Profile, state: ClusterState, enabled: bool = True) -> None:
        self.profile = profile
        self.state = state
        self.enabled = enabled and node_local(profile)
        self._tables: dict[tuple[Hashable, ...], ShapeTable] = {}
        self._seen_once: set[tuple[Hashable, ...]] = set()

    def table(self, cycle: Cycle) -> ShapeTable | None:
        """The table of the cycle's shape; None for a shape's first pod (a shape seen once
        is cheaper through the plugins on its candidates than over every node)."""
        if not self.enabled:
            return None
        key = shape_key(cycle.pod)
        found = self._tables.get(key)
        if found is not None:
            return found
        if key not in self._seen_once:
            self._seen_once.add(key)
            return None
        everything = np.arange(self.state.num_nodes, dtype=np.int64)
        raws = [np.asarray(plugin.score(cycle, self.state, everything), np.float64)
                for plugin, _ in self.profile.scores]
        found = ShapeTable(self._filtered(cycle, everything), raws, self.state.version,
                           [_constant(raw) for raw in raws])
        self._tables[key] = found
        return found

    def current(self, cycle: Cycle, table: ShapeTable, nodes: IntArray | None) -> None:
        """Bring the table up to date, if any of ``nodes`` (None: any node) changed since."""
        state = self.state
        if table.seen == state.version:
            return
        if nodes is not None and nodes.size and int(state.node_version[nodes].max()) <= table.seen:
            return
        stale = np.flatnonzero(state.node_version > table.seen)
        if stale.size:
            table.ok[stale] = self._filtered(cycle, stale)
            for i, (plugin, _) in enumerate(self.profile.scores):
                values = np.asarray(plugin.score(cycle, state, stale), np.float64)
                table.raw[i][stale] = values
                table.refreshed(i, values)
        table.seen = state.version

    def _filtered(self, cycle: Cycle, nodes: IntArray) -> BoolArray:
        ok = np.ones(nodes.size, np.bool_)
        for plugin in self.profile.filters:
            for _reason, rejected in plugin.filter(cycle, self.state, nodes):
                ok &= ~rejected
        return ok


def _constant(raw: FloatArray) -> float | None:
    """The one finite value of ``raw``, else None."""
    if not raw.size:
        return None
    low, high = float(raw.min()), float(raw.max())
    return low if low == high and np.isfinite(low) else None
