"""``gpucloud bench …``: performance benchmarks of gpucloud components."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from gpucloud.scheduler.registry import POLICY_NAMES
from gpucloud.sim.bench import GANG_LAYOUTS, run_bench, run_gang_bench

app = typer.Typer(help="Benchmarks.", no_args_is_help=True)
console = Console()
errors = Console(stderr=True, soft_wrap=True)


@app.callback()
def main() -> None:
    """Benchmarks (kept a command group so that ``gpucloud bench scheduler`` is stable)."""


@app.command()
def scheduler(
    nodes: Annotated[list[int] | None, typer.Option(
        help="Cluster size(s) in 8-GPU nodes (repeat the option for several).")] = None,
    pods: Annotated[int, typer.Option(min=1, help="Pods in the placement stream.")] = 5000,
    policy: Annotated[str, typer.Option(help="Scheduler profile.")] = "default",
    output: Annotated[str, typer.Option(help="table or json.")] = "table",
    gang: Annotated[int | None, typer.Option(
        min=1, help="Instead: place a gang of this many 8-GPU nodes (e.g. 64), repeatedly, "
        "on each cluster layout.")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Gang placements per layout.")] = 30,
) -> None:
    """Placements per second and p99 latency on a synthetic cluster of N 8-GPU nodes."""
    nodes = nodes or [1000]
    if output not in ("table", "json"):
        errors.print("[red]error:[/red] --output must be table or json")
        raise typer.Exit(1)
    if policy not in POLICY_NAMES:
        errors.print(f"[red]error:[/red] unknown policy {policy!r}")
        raise typer.Exit(1)
    if any(n < 1 for n in nodes):
        errors.print("[red]error:[/red] --nodes must be at least 1")
        raise typer.Exit(1)
    if gang is not None:
        _gang(nodes, gang, repeats, policy, output)
        return
    results = [run_bench(n, pods, policy).to_json() for n in nodes]
    if output == "json":
        console.print_json(json.dumps(results[0] if len(results) == 1 else results))
        return
    table = Table(title=f"scheduler placement throughput ({policy})")
    for column in ("nodes", "pods", "placed", "placements/s", "p50 ms", "p99 ms"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(str(r["nodes"]), str(r["pods"]), str(r["placed"]),
                      f"{r['placements_per_s']:.0f}", f"{r['p50_latency_ms']:.3f}",
                      f"{r['p99_latency_ms']:.3f}")
    console.print(table)


def _gang(nodes: list[int], members: int, repeats: int, policy: str, output: str) -> None:
    results = [run_gang_bench(n, members, layout, repeats, policy).to_json()
               for n in nodes for layout in GANG_LAYOUTS]
    if output == "json":
        console.print_json(json.dumps(results))
        return
    table = Table(title=f"gang placement latency ({policy})")
    for column in ("nodes", "members", "layout", "placed", "p50 ms", "p99 ms"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(str(r["nodes"]), str(r["members"]), str(r["layout"]), str(r["placed"]),
                      f"{r['p50_latency_ms']:.1f}", f"{r['p99_latency_ms']:.1f}")
    console.print(table)
