"""`gpucloud job …`: multi-node jobs, N member pods started together (gangs)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated

import typer

from gpucloud.cli import resources
from gpucloud.cli.common import (
    EVENT_TIME_FORMAT,
    FOLLOW_POLL_SECONDS,
    CliError,
    OutputFormat,
    OutputOption,
    cli_errors,
    client,
    emit,
    fields,
    table,
)
from gpucloud.cli.spec import SCHEDULING, SPEC, SpecValues, build_request, spec_options
from gpucloud.client import GpucloudClient
from gpucloud.core.jobs import DEFAULT_READY_TIMEOUT_SECONDS, JobCreateRequest, JobOut

app = typer.Typer(help="Multi-node jobs: N pods with G GPUs each, started together.",
                  no_args_is_help=True)
#: How ``logs --follow`` waits between polls; tests replace it to drive the job instead.
pause: Callable[[float], None] = time.sleep


def _show_job(job: JobOut) -> None:
    fields([
        ("id", job.id), ("name", job.name), ("project", job.project), ("phase", job.phase),
        ("reason", job.reason), ("message", job.message), ("image", job.image),
        ("command", " ".join(job.command)),
        ("nodes", f"{job.nodes} x {job.gpus_per_node} GPUs"
                  + (f" {job.gpu_type}" if job.gpu_type else "")),
        ("topology", job.topology.value), ("priority class", job.priority_class),
        ("restarts", f"{job.restarts} of {job.max_restarts}"),
        ("ready timeout", f"{job.ready_timeout:g}s"), ("master port", job.master_port),
        ("max duration", f"{job.max_duration:g}s" if job.max_duration else None),
        ("created", job.created_at.isoformat(timespec="seconds")),
    ])
    table(["RANK", "POD", "PHASE", "NODE", "ADDRESS", "READY", "REASON"],
          [[m.rank, m.pod, m.phase, m.node, m.address, "yes" if m.ready else "no", m.reason]
           for m in job.members])


@app.command()
@spec_options(*SPEC, *SCHEDULING)
def create(
    name: Annotated[str, typer.Argument(help="Job name (a DNS label); members are NAME-RANK")],
    nodes: Annotated[int, typer.Option(help="Number of members, one per node")] = 1,
    gpus_per_node: Annotated[int, typer.Option(help="Whole GPUs of each member")] = 0,
    topology: Annotated[str, typer.Option(help="same-block, same-rack or any")] = "any",
    max_restarts: Annotated[int, typer.Option(help="Gang restarts before Failed")] = 0,
    ready_timeout: Annotated[float, typer.Option(
        help="Seconds for every member to be ready at the start barrier")
    ] = DEFAULT_READY_TIMEOUT_SECONDS,
    output: OutputOption = OutputFormat.TABLE,
    *,
    spec: SpecValues,
) -> None:
    """Create a job: gpucloud job create NAME --nodes N --gpus-per-node G --image IMAGE -- CMD

    Each member gets the container spec (--cpu, --memory … are per member)."""
    with cli_errors():
        if "image" not in spec:
            raise CliError("--image is required")
        request = build_request(JobCreateRequest, {
            "name": name, "nodes": nodes, "gpus_per_node": gpus_per_node,
            "topology": topology, "max_restarts": max_restarts,
            "ready_timeout": ready_timeout, **spec,
        })
        job = client().create_job(request)
        emit(job, output, lambda: typer.echo(
            f"job {job.name} created ({job.id}): {job.nodes} members, {job.phase}"))


@app.command("list")
def list_(output: OutputOption = OutputFormat.TABLE) -> None:
    """List the project's jobs."""
    resources.list_rows(lambda api: api.list_jobs(), output,
                        ["NAME", "ID", "PHASE", "NODES", "GPUS/NODE", "TOPOLOGY", "RESTARTS",
                         "REASON"],
                        lambda j: [j.name, j.id[:12], j.phase, j.nodes, j.gpus_per_node,
                                   j.topology.value, j.restarts, j.reason])


@app.command()
def get(job: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Show one job (by id or name) and its members."""
    resources.show(lambda api: api.get_job(job), output, _show_job)


@app.command()
def why(job: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Why a job is pending: what the gang needs and what the cluster offers."""
    resources.say(lambda api: api.job_why(job), output, lambda answer: answer.summary)


@app.command()
def logs(
    job: str,
    follow: Annotated[bool, typer.Option(
        "--follow", "-f", help="Keep printing new lines until the job has ended")] = False,
    tail: Annotated[int | None, typer.Option(
        min=0, help="Only the last N lines of each member")] = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Every member's output (its current attempt), each line prefixed by its rank."""
    with cli_errors():
        if follow and output is OutputFormat.JSON:
            raise CliError("--follow prints lines as they come; use --output json without it")
        api = client()
        if follow:
            _follow(api, job, tail)
            return
        chunk = api.job_logs(job, tail=tail)
        emit(chunk, output, lambda: typer.echo(chunk.text, nl=False))


def _follow(api: GpucloudClient, job: str, tail: int | None) -> None:
    """Print whole new lines until the job has ended and all its output is printed, across
    gang restarts; Ctrl-C stops quietly with exit status 130."""
    try:
        chunk = api.job_logs(job, offsets="", tail=tail)
        typer.echo(chunk.text, nl=False)
        while not chunk.finished:
            pause(FOLLOW_POLL_SECONDS)
            chunk = api.job_logs(job, offsets=chunk.offsets)
            typer.echo(chunk.text, nl=False)
    except KeyboardInterrupt:  # not left to Typer/Click: Click's own handling says "aborted"
        raise typer.Exit(130) from None


@app.command()
def events(job: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """What happened to the job's members, oldest first, each with its rank."""
    resources.list_rows(lambda api: api.job_events(job), output,
                        ["TIME", "RANK", "FROM", "TO", "REASON", "MESSAGE"],
                        lambda e: [e.time.strftime(EVENT_TIME_FORMAT), e.rank, e.from_phase,
                                   e.to_phase, e.reason, e.message])


@app.command()
def stop(job: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Stop every member of a job."""
    with cli_errors():
        found = client().stop_job(job)
        note = "stopping" if found.phase != "Stopped" else found.phase
        emit(found, output, lambda: typer.echo(f"job {found.name}: {note}"))


@app.command()
def delete(job: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Delete a job and its members; running members are stopped."""
    resources.delete(lambda api: api.delete_job(job), "job", job, output)
