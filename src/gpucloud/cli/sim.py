"""``gpucloud sim …``: replay the FGD paper's trace experiments on the scheduler library,
and the checkpoint-interval experiment (``sim checkpoint``)."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Annotated

import numpy as np
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from gpucloud.cli import sim_data
from gpucloud.core.errors import GpucloudError
from gpucloud.core.quantities import parse_duration
from gpucloud.scheduler.framework.cluster import Allocation, ClusterState
from gpucloud.scheduler.registry import POLICY_NAMES, profile_configs
from gpucloud.scheduler.scheduler import to_placement
from gpucloud.scheduler.types import NodeState, PodRequest
from gpucloud.sim.checkpoint import DEFAULT_SETTINGS, IntervalResult, SettingResult, run_setting
from gpucloud.sim.data import find_workload, load_nodes, load_pods, workload_names
from gpucloud.sim.engine import RunResult, run_openb
from gpucloud.sim.jobs.engine import POLICIES as JOB_POLICIES
from gpucloud.sim.jobs.engine import run_jobs
from gpucloud.sim.jobs.metrics import JobsResult
from gpucloud.sim.jobs.trace import load_trace
from gpucloud.sim.load import PROFILES as LOAD_PROFILES
from gpucloud.sim.load import run_load
from gpucloud.sim.report import Summary, seeds, summarize

app = typer.Typer(help="Trace-driven scheduler simulations.", no_args_is_help=True)
console = Console()
errors = Console(stderr=True, soft_wrap=True)
app.add_typer(sim_data.app, name="data")


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
    try:
        names = workload_names()
    except GpucloudError as exc:
        raise fail(exc.message) from exc
    if not names:
        raise fail("no workloads found (set GPUCLOUD_SHARED_DATA to the shared data folder)")
    for name in names:
        console.print(name)


def _setting(text: str) -> tuple[float, float]:
    """``DELTA:M`` durations (``5m:24h``)."""
    delta, sep, mtbf = text.partition(":")
    if not sep:
        raise fail(f"--setting {text!r} is not DELTA:M (e.g. 5m:24h)")
    try:
        values = parse_duration("setting", delta), parse_duration("setting", mtbf)
    except GpucloudError as exc:
        raise fail(exc.message) from exc
    if min(values) <= 0:
        raise fail(f"--setting {text!r}: both durations must be positive")
    return values


@app.command()
def checkpoint(
    setting: Annotated[list[str] | None, typer.Option(
        help="DELTA:M (checkpoint cost : mean time between interruptions), repeatable; "
        "default: 5m:24h 5m:6h 1m:1h 30s:4h 5m:2h.")] = None,
    restart: Annotated[str, typer.Option(help="Restart cost R.")] = "10m",
    work: Annotated[str, typer.Option(help="The job's total work W.")] = "1000h",
    seeds_: Annotated[int, typer.Option("--seeds", min=1, help="Seeds 42, 43, …")] = 20,
    output: Annotated[str, typer.Option(help="table or json.")] = "table",
) -> None:
    """Lost-work fraction under Poisson interruptions: Daly's interval vs the analytic
    optimum and fixed intervals (5m, 30m, 2h)."""
    if output not in ("table", "json"):
        raise fail("--output must be table or json")
    settings = [_setting(s) for s in setting] if setting else list(DEFAULT_SETTINGS)
    try:
        restart_s, work_s = parse_duration("restart", restart), parse_duration("work", work)
    except GpucloudError as exc:
        raise fail(exc.message) from exc
    if work_s <= 0:
        raise fail("--work must be positive")
    results = [run_setting(delta, mtbf, seeds(seeds_), restart=restart_s, work=work_s)
               for delta, mtbf in settings]
    if output == "json":
        console.print_json(json.dumps([r.to_json() for r in results]))
    else:
        console.print(_checkpoint_table(results, seeds_))


def _checkpoint_table(results: list[SettingResult], seed_count: int) -> Table:
    first = results[0]
    table = Table(title=f"lost-work % (R = {first.restart / 60:g} min, W = "
                  f"{first.work / 3600:g} h, {seed_count} seeds; mean ± std)")
    for column in ("δ", "M", "optimum τ", "optimum %", "Daly τ", "Daly %", "Daly vs opt",
                   *(r.label for r in first.intervals[1:])):
        table.add_column(column, justify="right")
    for r in results:
        cells = [f"{r.delta / 60:g} min", f"{r.mtbf / 3600:g} h",
                 f"{r.optimum_tau / 60:.1f} min", f"{100 * r.optimum_lost:.2f}",
                 f"{r.daly.tau / 60:.1f} min", _percent(r.daly),
                 f"{100 * r.daly_vs_optimum:+.1f} %"]
        table.add_row(*cells, *(_percent(i) for i in r.intervals[1:]))
    return table


def _percent(result: IntervalResult) -> str:
    bound = "≥ " if result.capped else ""
    return f"{bound}{100 * result.mean:.2f} ± {100 * result.spread:.2f}"


@app.command("load")
def load_experiment(
    workload: Annotated[str, typer.Option(help="Workload name (openb), e.g. default.")
                        ] = "default",
    profile: Annotated[str, typer.Option(help="Comma list of profiles.")] = ",".join(
        LOAD_PROFILES),
    seeds_: Annotated[int, typer.Option("--seeds", min=1, help="Seeds 42, 43, …")] = 3,
    tune: Annotated[float, typer.Option(min=0.01, help="Arrived GPU request / capacity.")] = 1.0,
    output: Annotated[str, typer.Option(help="table or json.")] = "table",
) -> None:
    """Pods whose real use differs from their requests (sim/load.py): hot nodes and
    allocation for default vs default+load-aware."""
    if output not in ("table", "json"):
        raise fail("--output must be table or json")
    names = [p.strip() for p in profile.split(",") if p.strip()]
    known = set(profile_configs())
    unknown = [p for p in names if p not in known]
    if unknown or not names:
        raise fail(f"unknown profile {(unknown or [profile])[0]!r}")
    try:
        found = find_workload(workload)
        node_list, pod_list = load_nodes(found.nodes_csv), load_pods(found.pods_csv)
    except GpucloudError as exc:
        raise fail(exc.message) from exc
    runs = [run_load(node_list, pod_list, name, seed, tune)
            for name in names for seed in seeds(seeds_)]
    if output == "json":
        console.print_json(json.dumps([r.to_json() for r in runs]))
        return
    table = Table(title=f"openb {workload}: real use ≠ requests, mean of {seeds_} seeds")
    for column in ("profile", "hot nodes (>80 %)", "allocation %", "unallocated GPU %",
                   "pods placed %", "max node CPU use %"):
        table.add_column(column, justify="left" if column == "profile" else "right")
    for name in names:
        mine = [r for r in runs if r.profile == name]
        table.add_row(name, f"{np.mean([r.hot_nodes for r in mine]):.1f}",
                      f"{np.mean([r.allocation_pct for r in mine]):.2f}",
                      f"{np.mean([r.unallocated_gpu_pct for r in mine]):.2f}",
                      f"{np.mean([r.placed_pct for r in mine]):.2f}",
                      f"{np.mean([r.max_cpu_use_pct for r in mine]):.1f}")
    console.print(table)
