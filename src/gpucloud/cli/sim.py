"""``gpucloud sim …``: replay the FGD paper's trace experiments on the scheduler library."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Annotated

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from gpucloud.core.errors import GpucloudError
from gpucloud.scheduler.framework.cluster import Allocation, ClusterState
from gpucloud.scheduler.registry import POLICY_NAMES
from gpucloud.scheduler.scheduler import to_placement
from gpucloud.scheduler.types import NodeState, PodRequest
from gpucloud.sim.data import find_workload, load_nodes, load_pods, workload_names
from gpucloud.sim.engine import RunResult, run_openb
from gpucloud.sim.jobs.engine import POLICIES as JOB_POLICIES
from gpucloud.sim.jobs.engine import run_jobs
from gpucloud.sim.jobs.metrics import JobsResult
from gpucloud.sim.jobs.trace import load_trace
from gpucloud.sim.report import Summary, seeds, summarize

app = typer.Typer(help="Trace-driven scheduler simulations.", no_args_is_help=True)
console = Console()
errors = Console(stderr=True, soft_wrap=True)


def fail(message: str) -> typer.Exit:
    """Print one readable line and return the exit to raise."""
    errors.print(f"[red]error:[/red] {message}", highlight=False)
    return typer.Exit(code=1)


class _Dumper:
    """Writes one JSON line per arrived pod (``--dump-placements``)."""

    def __init__(self, handle: IO[str] | None) -> None:
        self.handle = handle
        self.seed = 0

    def __call__(self, pod: PodRequest, allocation: Allocation | None,
                 state: ClusterState) -> None:
        if self.handle is None:
            return
        placement = to_placement(pod, allocation, state) if allocation else None
        record = {"seed": self.seed, "pod": pod.key,
                  "node": placement.node if placement else None,
                  "gpus": {str(k): v for k, v in placement.gpu_milli.items()} if placement
                  else {}}
        self.handle.write(json.dumps(record) + "\n")


@contextmanager
def _dump_file(path: Path | None) -> Iterator[IO[str] | None]:
    if path is None:
        yield None
        return
    try:
        handle = path.open("w")
    except OSError as exc:
        raise fail(f"cannot write {path}: {exc.strerror}") from exc
    with handle:
        yield handle


def _inputs(workload: str | None, nodes_csv: Path | None, pods_csv: Path | None,
            ) -> tuple[str, Path, Path]:
    if workload is not None:
        found = find_workload(workload)
        return found.name, nodes_csv or found.nodes_csv, pods_csv or found.pods_csv
    if nodes_csv is None or pods_csv is None:
        raise fail("give --workload NAME, or both --nodes NODES.csv and --pods PODS.csv")
    return pods_csv.stem.removeprefix("openb_pod_list_"), nodes_csv, pods_csv


def _policies(policy: str) -> list[str]:
    if policy == "all":
        return list(POLICY_NAMES)
    names = [p.strip() for p in policy.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICY_NAMES]
    if unknown:
        raise fail(f"unknown policy {unknown[0]!r}; choose from {', '.join(POLICY_NAMES)}, all")
    return names


def _table(summaries: list[Summary]) -> Table:
    table = Table(title=f"openb {summaries[0].workload}: unallocated GPU % at arrived = 100 %")
    for column in ("policy", "mean", "spread (std)", "frag % of idle", "published", "seeds"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for s in summaries:
        published = s.to_json()["published_unallocated_pct_at_100"]
        table.add_row(s.policy, f"{s.mean:.2f}", f"{s.spread:.2f}", f"{s.frag_mean:.1f}",
                      "-" if published is None else f"{published:.2f}", str(len(s.runs)))
    return table


@app.command()
def openb(
    workload: Annotated[str | None, typer.Option(help="Workload name in the shared data "
                                                 "folder, e.g. default, gpushare40.")] = None,
    nodes: Annotated[Path | None, typer.Option(help="Node list CSV.")] = None,
    pods: Annotated[Path | None, typer.Option(help="Pod list CSV.")] = None,
    policy: Annotated[str, typer.Option(help="Policy name, comma list, or 'all'.")] = "default",
    seeds_: Annotated[int, typer.Option("--seeds", min=1, help="Seeds 42, 43, …")] = 10,
    tune: Annotated[float, typer.Option(min=0.01, help="Arrived GPU request / capacity.")] = 1.3,
    output: Annotated[str, typer.Option(help="table or json.")] = "table",
    plot: Annotated[Path | None, typer.Option(help="Write allocation curves (PNG).")] = None,
    dump_placements: Annotated[Path | None, typer.Option(
        help="Write one JSON line per arrived pod.")] = None,
) -> None:
    """Run the FGD paper's protocol: unallocated GPU % at arrived = 100 % per policy."""
    if output not in ("table", "json"):
        raise fail("--output must be table or json")
    try:
        name, nodes_csv, pods_csv = _inputs(workload, nodes, pods)
        node_list, pod_list = load_nodes(nodes_csv), load_pods(pods_csv)
    except GpucloudError as exc:
        raise fail(exc.message) from exc
    if not node_list or not pod_list:
        raise fail("the node or pod list is empty")
    policies = _policies(policy)
    with _dump_file(dump_placements) as handle:
        summaries = _run_all(name, node_list, pod_list, policies, seeds(seeds_), tune,
                             _Dumper(handle), quiet=output == "json")
    if plot is not None:
        _plot(summaries, plot)
    if output == "json":
        payload = [s.to_json() for s in summaries]
        console.print_json(json.dumps(payload[0] if len(payload) == 1 else payload))
    else:
        console.print(_table(summaries))


def _run_all(name: str, node_list: list[NodeState], pod_list: list[PodRequest],
             policies: list[str], seed_list: list[int], tune: float, dumper: _Dumper,
             quiet: bool) -> list[Summary]:
    summaries = []
    with Progress(console=errors, transient=True, disable=quiet) as progress:
        task = progress.add_task("simulating", total=len(policies) * len(seed_list))
        for policy in policies:
            runs: list[RunResult] = []
            for seed in seed_list:
                dumper.seed = seed
                runs.append(run_openb(node_list, pod_list, policy, seed, tune, dumper))
                progress.advance(task)
            summaries.append(summarize(policy, name, runs))
    return summaries


def _plot(summaries: list[Summary], path: Path) -> None:
    try:
        plotting = importlib.import_module("gpucloud.sim.plot")
    except ImportError as exc:
        raise fail("--plot needs matplotlib (pip install 'gpucloud[plot]')") from exc
    try:
        plotting.plot_curves(summaries, path)
    except OSError as exc:
        raise fail(f"cannot write {path}: {exc.strerror}") from exc


@app.command()
def jobs(
    trace: Annotated[Path, typer.Option(help="Job trace CSV (philly.csv or a Tiresias job "
                                        "list).")],
    policy: Annotated[str, typer.Option(
        help="fifo, backfill, priority, drf, a comma list, or all.")] = "all",
    nodes: Annotated[int, typer.Option(min=1, help="Nodes in the cluster.")] = 64,
    gpus_per_node: Annotated[int, typer.Option(min=1, max=64, help="GPUs per node.")] = 8,
    limit: Annotated[int | None, typer.Option(min=1, help="Replay only the first JOBS jobs "
                                              "by arrival.", metavar="JOBS")] = None,
    profile: Annotated[str, typer.Option(help="Scheduler profile placing the jobs.")] = "default",
    output: Annotated[str, typer.Option(help="table or json.")] = "table",
) -> None:
    """Replay a job trace (arrivals, durations, GPUs) under queueing policies."""
    if output not in ("table", "json"):
        raise fail("--output must be table or json")
    if profile not in POLICY_NAMES:
        raise fail(f"unknown profile {profile!r}; choose from {', '.join(POLICY_NAMES)}")
    names = list(JOB_POLICIES) if policy == "all" else [
        p.strip() for p in policy.split(",") if p.strip()]
    unknown = [p for p in names if p not in JOB_POLICIES]
    if unknown or not names:
        raise fail(f"unknown policy {(unknown or [policy])[0]!r}; choose from "
                   f"{', '.join(JOB_POLICIES)}, all")
    try:
        job_list = load_trace(trace, limit)
    except GpucloudError as exc:
        raise fail(exc.message) from exc
    results = []
    with Progress(console=errors, transient=True, disable=output == "json") as progress:
        task = progress.add_task("simulating", total=len(names))
        for name in names:
            results.append(run_jobs(job_list, name, nodes, gpus_per_node, profile))
            progress.advance(task)
    if output == "json":
        payload = [r.to_json() for r in results]
        console.print_json(json.dumps(payload[0] if len(payload) == 1 else payload))
    else:
        console.print(_jobs_table(results, f"{trace.name}: {nodes} x {gpus_per_node} GPUs"))


def _jobs_table(results: list[JobsResult], title: str) -> Table:
    table = Table(title=title)
    for column in ("policy", "jobs", "mean JCT h", "p99 JCT h", "mean queue h", "p99 queue h",
                   "GPU util %", "makespan d"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for r in results:
        table.add_row(r.policy, str(r.jobs), f"{r.mean_jct_s / 3600:.2f}",
                      f"{r.p99_jct_s / 3600:.2f}", f"{r.mean_queue_s / 3600:.2f}",
                      f"{r.p99_queue_s / 3600:.2f}", f"{r.utilization_pct:.1f}",
                      f"{r.makespan_s / 86400:.2f}")
    return table


@app.command()
def workloads() -> None:
    """List the workloads found in the shared data folder."""
    names = workload_names()
    if not names:
        raise fail("no workloads found (set GPUCLOUD_SHARED_DATA to the shared data folder)")
    for name in names:
        console.print(name)
