"""The GPU catalog RunPod's clients read, from the live fleet and the price catalog: one
computation that GraphQL's ``gpuTypes`` and REST v2's ``/catalog/gpus`` both render.

Per GPU model (canonical gpucloud name) over the nodes that are not Lost: the GPUs there
(``total``, ``most_on_a_node``), how many of them are free now on Ready, uncordoned nodes
(``free``, ``most_free_on_a_node``: a node's allocated GPUs are taken from its own models'
counts), the memory, and the on-demand and spot price of one GPU-hour in effect now.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from gpucloud.compat.runpod import mapping
from gpucloud.core.gpu_models import lookup
from gpucloud.core.models import NodeOut
from gpucloud.core.phases import NodeStatus
from gpucloud.services import nodes, prices
from gpucloud.services.context import ServiceContext


@dataclass
class GpuStock:
    """One GPU model across the live fleet, priced."""

    model: str
    memory_mib: int = 0
    total: int = 0
    most_on_a_node: int = 0
    free: int = 0
    most_free_on_a_node: int = 0
    on_demand: float = 0.0
    spot: float = 0.0

    @property
    def type_id(self) -> str:
        return mapping.gpu_type_id(self.model)

    @property
    def display_name(self) -> str:
        return mapping.gpu_display_name(self.model)

    @property
    def memory_gb(self) -> int:
        known = lookup(self.model)
        return round((self.memory_mib or (known.memory_mib if known else 0)) / 1024)


def gpu_catalog(ctx: ServiceContext, wanted: set[str] | None = None) -> list[GpuStock]:
    """Every model of the live fleet (``wanted``: only those canonical models), by name."""
    stock: dict[str, GpuStock] = {}
    for node in nodes.list_nodes(ctx):
        if node.status is NodeStatus.LOST:
            continue
        counts = Counter(mapping.gpu_model(g.model) for g in node.gpus)
        free_here = _free_on(node, counts)
        for model, count in counts.items():
            if wanted is not None and model not in wanted:
                continue
            entry = stock.setdefault(model, GpuStock(model))
            entry.memory_mib = max(entry.memory_mib, _memory(node, model))
            entry.total += count
            entry.most_on_a_node = max(entry.most_on_a_node, count)
            entry.free += free_here.get(model, 0)
            entry.most_free_on_a_node = max(entry.most_free_on_a_node,
                                            free_here.get(model, 0))
    _price(ctx, stock.values())
    return [stock[model] for model in sorted(stock)]


def _price(ctx: ServiceContext, entries: Iterable[GpuStock]) -> None:
    with ctx.db.read() as session:
        book = prices.load_book(session)
    now = ctx.clock.now()
    for entry in entries:
        entry.on_demand = float(mapping.hourly_price(book, entry.model, 1, 0, False, now))
        entry.spot = float(mapping.hourly_price(book, entry.model, 1, 0, True, now))


def _memory(node: NodeOut, model: str) -> int:
    return max((g.memory_mib for g in node.gpus if mapping.gpu_model(g.model) == model),
               default=0)


def _free_on(node: NodeOut, counts: Counter[str]) -> dict[str, int]:
    if node.status is not NodeStatus.READY or node.cordoned:
        return {}
    left = node.gpus_allocated
    free: dict[str, int] = {}
    for model, count in sorted(counts.items()):
        used = min(left, count)
        left -= used
        free[model] = count - used
    return free
