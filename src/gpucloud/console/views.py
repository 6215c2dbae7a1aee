"""Presentation for the console: the GPU grid, free capacity, and the usage charts (inline
SVG drawn here, so the pages need no chart library)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, timedelta
from decimal import Decimal
from html import escape

from gpucloud.core.models import GpuInventory, NodeOut
from gpucloud.core.phases import NodeStatus
from gpucloud.services.occupancy import GpuUse

MIG_SLOTS = 7


@dataclass(frozen=True)
class GpuCell:
    """One GPU square of a node's grid: its state, a label, and MIG slots or a share."""

    index: int
    model: str
    state: str  # free | whole | shared | mig | unhealthy
    title: str
    share_percent: int = 0
    slots: tuple[str, ...] = ()  # per MIG slot: "" (free) or the pod holding it


def gpu_cells(node: NodeOut, uses: dict[str, GpuUse]) -> list[GpuCell]:
    return [_cell(i, gpu, uses.get(gpu.uuid, GpuUse())) for i, gpu in enumerate(node.gpus)]


def _cell(index: int, gpu: GpuInventory, use: GpuUse) -> GpuCell:
    number = gpu.index if gpu.index is not None else index
    name = f"GPU {number} ({gpu.model})"
    if not gpu.healthy:
        return GpuCell(number, gpu.model, "unhealthy",
                       f"{name}: unhealthy ({gpu.health_reason or 'health check'})")
    if use.whole:
        return GpuCell(number, gpu.model, "whole", f"{name}: whole, {use.whole}")
    if use.mig:
        slots = [""] * MIG_SLOTS
        for device in use.mig:
            for slot in range(device.slot, min(MIG_SLOTS, device.slot + device.slices)):
                slots[slot] = f"{device.profile} {device.pod}"
        held = ", ".join(f"{d.profile} ({d.pod})" for d in use.mig)
        return GpuCell(number, gpu.model, "mig", f"{name}: MIG {held}", slots=tuple(slots))
    if use.shares:
        percent = min(100, round(use.milli_used / 10))
        held = ", ".join(f"{pod} {milli / 1000:g}" for pod, milli in use.shares.items())
        return GpuCell(number, gpu.model, "shared", f"{name}: shared {percent}% ({held})",
                       share_percent=percent)
    return GpuCell(number, gpu.model, "free", f"{name}: free")


def free_capacity(nodes: list[NodeOut], occupancy: dict[str, dict[str, GpuUse]]
                  ) -> dict[str, int]:
    """GPU model → the most GPUs of it wholly free on one schedulable node (what a single
    pod can ask for now)."""
    best: dict[str, int] = {}
    for node in nodes:
        if node.status is not NodeStatus.READY or node.cordoned or node.drain is not None:
            continue
        uses = occupancy.get(node.id, {})
        counts: dict[str, int] = {}
        for gpu in node.gpus:
            if gpu.healthy and uses.get(gpu.uuid, GpuUse()).free:
                counts[gpu.model] = counts.get(gpu.model, 0) + 1
        for model, count in counts.items():
            best[model] = max(best.get(model, 0), count)
    return dict(sorted(best.items()))


@dataclass(frozen=True)
class Bar:
    label: str
    value: float
    text: str


def days(until: date, count: int) -> list[str]:
    return [(until - timedelta(days=count - 1 - i)).isoformat() for i in range(count)]


def column_chart(bars: list[Bar], title: str, width: int = 640, height: int = 220) -> str:
    """Vertical bars with labels under every few columns; ``<title>`` per bar for hover
    and screen readers (the numbers are also in the table beside it)."""
    top = max((b.value for b in bars), default=0) or 1.0
    pad, base = 60, height - 28
    step = (width - pad) / max(len(bars), 1)
    parts = [_svg_open(width, height, title),
             f'<line x1="{pad}" y1="{base}" x2="{width}" y2="{base}" class="axis"/>',
             f'<text x="{pad - 4}" y="14" class="tick" text-anchor="end">{top:.2g}</text>',
             f'<text x="{pad - 4}" y="{base}" class="tick" text-anchor="end">0</text>']
    label_every = max(1, len(bars) // 7)
    for i, bar in enumerate(bars):
        h = (base - 10) * bar.value / top
        x = pad + i * step + step * 0.15
        parts.append(f'<rect x="{x:.1f}" y="{base - h:.1f}" width="{step * 0.7:.1f}" '
                     f'height="{h:.1f}" class="bar"><title>{escape(bar.label)}: '
                     f'{escape(bar.text)}</title></rect>')
        if i % label_every == 0:
            parts.append(f'<text x="{x + step * 0.35:.1f}" y="{height - 10}" class="tick" '
                         f'text-anchor="middle">{escape(bar.label[5:])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def row_chart(bars: list[Bar], title: str, width: int = 640) -> str:
    """Horizontal bars, one per row (cost per project)."""
    row = 28
    height = row * max(len(bars), 1) + 8
    top = max((b.value for b in bars), default=0) or 1.0
    label_width = 150
    parts = [_svg_open(width, height, title)]
    for i, bar in enumerate(bars):
        y = 4 + i * row
        w = (width - label_width - 120) * bar.value / top
        parts.append(f'<text x="{label_width - 8}" y="{y + 17}" class="label" '
                     f'text-anchor="end">{escape(bar.label)}</text>'
                     f'<rect x="{label_width}" y="{y + 4}" width="{w:.1f}" height="{row - 10}"'
                     f' class="bar"><title>{escape(bar.label)}: {escape(bar.text)}</title>'
                     f'</rect><text x="{label_width + w + 6:.1f}" y="{y + 17}" '
                     f'class="label">{escape(bar.text)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _svg_open(width: int, height: int, title: str) -> str:
    return (f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="{escape(title)}" preserveAspectRatio="xMinYMin meet">'
            f'<title>{escape(title)}</title>')


def money(value: Decimal) -> str:
    return f"${value:,.4f}" if value < 1 else f"${value:,.2f}"
