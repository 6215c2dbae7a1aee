"""The console's presentation helpers: GPU grid cells, free capacity, charts."""

from __future__ import annotations

import re
from datetime import UTC, datetime

from gpucloud.console.views import Bar, column_chart, free_capacity, gpu_cells, row_chart
from gpucloud.console.web import iso
from gpucloud.core.models import GpuInventory, NodeOut
from gpucloud.core.phases import NodeStatus
from gpucloud.services.occupancy import GpuUse, MigUse, mig_slices


def _node(count: int = 4, cordoned: bool = False, status: NodeStatus = NodeStatus.READY
          ) -> NodeOut:
    gpus = [GpuInventory(uuid=f"G{i}", model="H100-80GB", memory_mib=81559, index=i)
            for i in range(count)]
    return NodeOut(id="n1", name="n1", status=status, cordoned=cordoned, cpu_cores=64,
                   memory_bytes=1 << 40, gpus=gpus, fencing_token=1,
                   registered_at=datetime(2026, 1, 1, tzinfo=UTC))


def test_cells_show_whole_shared_mig_and_unhealthy() -> None:
    node = _node()
    node.gpus[3].healthy, node.gpus[3].health_reason = False, "XID 48"
    uses = {"G0": GpuUse(whole="train"), "G1": GpuUse(shares={"a": 250, "b": 500}),
            "G2": GpuUse(mig=[MigUse(0, 3, "3g.40gb", "x"), MigUse(4, 2, "2g.20gb", "y")])}
    cells = gpu_cells(node, uses)
    assert [c.state for c in cells] == ["whole", "shared", "mig", "unhealthy"]
    assert cells[1].share_percent == 75 and "a 0.25, b 0.5" in cells[1].title
    assert [bool(s) for s in cells[2].slots] == [True, True, True, False, True, True, False]
    assert "XID 48" in cells[3].title


def test_free_capacity_counts_free_healthy_gpus_on_schedulable_nodes() -> None:
    ready, cordoned = _node(4), _node(8, cordoned=True)
    cordoned.id = "n2"
    lost = _node(8, status=NodeStatus.LOST)
    lost.id = "n3"
    uses = {"n1": {"G0": GpuUse(whole="p"), "G1": GpuUse(shares={"q": 100})}}
    assert free_capacity([ready, cordoned, lost], uses) == {"H100-80GB": 2}
    assert free_capacity([], {}) == {}


def test_mig_profile_slices() -> None:
    assert [mig_slices(p) for p in ("1g.10gb", "3g.40gb", "7g.80gb", "odd")] == [1, 3, 7, 1]


def test_charts_escape_labels_and_scale_to_the_largest_bar() -> None:
    svg = column_chart([Bar("2026-01-01", 2.0, "2 h"), Bar("2026-01-02", 1.0, "<1 h>")], "t")
    assert svg.startswith("<svg") and "&lt;1 h&gt;" in svg and 'role="img"' in svg
    heights = [float(h) for h in re.findall(r'<rect [^>]*height="([0-9.]+)"', svg)]
    assert heights[0] == 2 * heights[1]
    assert "a&amp;b" in row_chart([Bar("a&b", 1.0, "$1")], "cost")


def test_times_are_utc_iso() -> None:
    assert iso(datetime(2026, 1, 1, 12, 0)) == "2026-01-01T12:00:00Z"
    assert iso(None) == ""
