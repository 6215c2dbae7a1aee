"""Nodes (the GPU grid; cordon and drain for
admins) and usage (GPU-hours per day, cost per project)."""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, Request, Response

from gpucloud.console.views import Bar, column_chart, days, gpu_cells, money, row_chart
from gpucloud.console.web import ConsoleRoute, CurrentViewer, Form, back, page
from gpucloud.core.billing import UsageBy
from gpucloud.core.spot import NodeDrainRequest
from gpucloud.services import billing, drain, nodes, occupancy, projects

router = APIRouter(prefix="/console", route_class=ConsoleRoute, include_in_schema=False)

#: The usage page's window.
USAGE_DAYS = 14


def _wake(request: Request) -> None:
    runner = getattr(request.app.state, "controllers", None)
    if runner is not None:
        runner.wake()


@router.get("/nodes")
def node_list(request: Request, viewer: CurrentViewer) -> Response:
    listed = nodes.list_nodes(viewer.ctx)
    grid = occupancy.gpu_occupancy(viewer.ctx, viewer.principal)
    cells = {n.id: gpu_cells(n, grid.get(n.id, {})) for n in listed}
    return page(request, "nodes.html", viewer, nodes=listed, cells=cells)


@router.post("/nodes/{ref}/cordon")
def node_cordon(ref: str, viewer: CurrentViewer, _form: Form) -> Response:
    nodes.set_cordoned(viewer.ctx, viewer.principal, ref, True)
    return back("/console/nodes")


@router.post("/nodes/{ref}/uncordon")
def node_uncordon(ref: str, request: Request, viewer: CurrentViewer, _form: Form) -> Response:
    nodes.set_cordoned(viewer.ctx, viewer.principal, ref, False)
    _wake(request)
    return back("/console/nodes")


@router.post("/nodes/{ref}/drain")
def node_drain(ref: str, request: Request, viewer: CurrentViewer, form: Form) -> Response:
    deadline = form.get("deadline", "").strip() or None
    drain.drain_node(viewer.ctx, viewer.principal, ref, NodeDrainRequest(deadline=deadline))
    _wake(request)
    return back("/console/nodes")


@router.post("/nodes/{ref}/undrain")
def node_undrain(ref: str, request: Request, viewer: CurrentViewer, _form: Form) -> Response:
    drain.undrain_node(viewer.ctx, viewer.principal, ref)
    _wake(request)
    return back("/console/nodes")


@router.get("/usage")
def usage_page(request: Request, viewer: CurrentViewer) -> Response:
    ctx, caller = viewer.ctx, viewer.principal
    now = ctx.clock.now()
    since = (now - timedelta(days=USAGE_DAYS - 1)).replace(hour=0, minute=0, second=0,
                                                           microsecond=0)
    daily = billing.usage(ctx, caller, None, since, None, UsageBy.DAY)
    hours = {row.day or row.key: row.gpu_seconds / 3600 for row in daily.rows}
    day_bars = [Bar(d, hours.get(d, 0.0), f"{hours.get(d, 0.0):.3f} GPU-h")
                for d in days(now.date(), USAGE_DAYS)]
    by_pod = billing.usage(ctx, caller, None, since, None, UsageBy.POD)
    totals = [(p.name, billing.usage(ctx, caller, p.name, since, None, UsageBy.DAY).total_cost)
              for p in projects.list_projects(ctx, caller)]
    project_bars = [Bar(name, float(cost), money(cost)) for name, cost in totals]
    return page(request, "usage.html", viewer, since=since, pods=by_pod.rows,
                total=money(by_pod.total_cost), money=money,
                day_chart=column_chart(day_bars, "GPU-hours per day"),
                project_chart=row_chart(project_bars, "Cost per project"),
                day_bars=day_bars, project_bars=project_bars)
