"""`gpucloud pod …`: create, inspect, follow and control pods."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from pydantic import ValidationError

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
    parse_env,
    table,
    validation_message,
)
from gpucloud.core.models import PodCreateRequest, PodOut

app = typer.Typer(help="GPU pods: containers with GPUs.", no_args_is_help=True)


def _show_pod(pod: PodOut) -> None:
    fields([
        ("id", pod.id), ("name", pod.name), ("project", pod.project), ("phase", pod.phase),
        ("reason", pod.reason), ("message", pod.message), ("node", pod.node),
        ("image", pod.image), ("command", " ".join(pod.command)),
        ("gpus", f"{pod.gpus:g}" + (f" x {pod.gpu_type}" if pod.gpu_type else "")),
        ("gpu uuids", ", ".join(pod.gpu_uuids)), ("cpu", f"{pod.cpu:g}"),
        ("memory", pod.memory), ("env", ", ".join(f"{k}={v}" for k, v in pod.env.items())),
        ("ports", ", ".join(pod.ports)), ("restart", pod.restart.value),
        ("restarts", pod.restart_count), ("exit code", pod.exit_code),
        ("max duration", f"{pod.max_duration:g}s" if pod.max_duration else None),
        ("created", pod.created_at.isoformat(timespec="seconds")),
    ])


@app.command()
def create(
    name: Annotated[str, typer.Argument(help="Pod name (a DNS label), unique in the project")],
    command: Annotated[list[str] | None, typer.Argument(help="Command and args, after --")] = None,
    image: Annotated[str, typer.Option(help="Container image reference")] = "",
    gpus: Annotated[float, typer.Option(help="Whole GPUs, or a share below 1 (0.5)")] = 0,
    gpu_type: Annotated[str | None, typer.Option(help="GPU model, e.g. H100-80GB")] = None,
    cpu: Annotated[str, typer.Option(help="CPU cores: 2, 0.5 or 500m")] = "1",
    memory: Annotated[str, typer.Option(help="Memory: 512Mi, 16Gi …")] = "1Gi",
    env: Annotated[list[str] | None, typer.Option(help="KEY=VALUE, repeatable")] = None,
    port: Annotated[list[str] | None, typer.Option(help="PORT[/http|tcp], repeatable")] = None,
    restart: Annotated[str, typer.Option(help="never, on-failure or always")] = "never",
    priority_class: Annotated[str | None, typer.Option(
        help="spot, batch (default), on-demand or another class")] = None,
    max_duration: Annotated[str | None, typer.Option(
        help="Stop it after this long (90, 30m, 2h); lets it backfill")] = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Create a pod: gpucloud pod create NAME --image IMAGE [--gpus N] -- COMMAND [ARGS...]"""
    with cli_errors():
        if not image:
            raise CliError("--image is required")
        try:
            request = PodCreateRequest.model_validate({
                "name": name, "image": image, "command": command or [], "gpus": gpus,
                "gpu_type": gpu_type, "cpu": cpu, "memory": memory,
                "env": parse_env(env or []), "ports": port or [], "restart": restart,
                "priority_class": priority_class, "max_duration": max_duration,
            })
        except ValidationError as error:
            raise CliError(validation_message(error)) from None
        pod = client().create_pod(request)
        emit(pod, output, lambda: typer.echo(f"pod {pod.name} created ({pod.id}): {pod.phase}"))


@app.command("list")
def list_(phase: Annotated[str | None, typer.Option(help="Only pods in this phase")] = None,
          output: OutputOption = OutputFormat.TABLE) -> None:
    """List the project's pods."""
    with cli_errors():
        pods = client().list_pods(phase)
        emit(pods, output, lambda: table(
            ["NAME", "ID", "PHASE", "NODE", "GPUS", "IMAGE", "REASON"],
            [[p.name, p.id[:12], p.phase, p.node, f"{p.gpus:g}", p.image, p.reason]
             for p in pods],
        ))


@app.command()
def get(pod: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Show one pod (by id or name)."""
    with cli_errors():
        found = client().get_pod(pod)
        emit(found, output, lambda: _show_pod(found))


@app.command()
def events(pod: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """The pod's phase changes, with times and reasons."""
    with cli_errors():
        items = client().pod_events(pod)
        emit(items, output, lambda: table(
            ["TIME", "FROM", "TO", "REASON", "MESSAGE"],
            [[e.time.strftime(EVENT_TIME_FORMAT), e.from_phase, e.to_phase, e.reason,
              e.message] for e in items],
        ))


@app.command()
def why(pod: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Why a pod is pending: how many nodes were rejected for each reason."""
    with cli_errors():
        answer = client().pod_why(pod)
        emit(answer, output, lambda: typer.echo(answer.summary))


@app.command()
def logs(
    pod: str,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new output")
    ] = False,
    tail: Annotated[int | None, typer.Option(help="Only the last N bytes")] = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """The pod's output (stdout and stderr) of its current run."""
    with cli_errors():
        api = client()
        chunk = api.pod_logs(pod, tail=tail)
        if output is OutputFormat.JSON:
            emit(chunk, output, lambda: None)
            return
        typer.echo(chunk.text, nl=False)
        while follow and not chunk.finished:
            time.sleep(FOLLOW_POLL_SECONDS)
            chunk = api.pod_logs(pod, offset=chunk.next_offset, attempt=chunk.attempt)
            typer.echo(chunk.text, nl=False)


def _action(verb: str, pod: str, output: OutputFormat, grace: float | None = None) -> None:
    with cli_errors():
        api = client()
        found = api.stop_pod(pod, grace) if verb == "stop" else api.start_pod(pod)
        note = "stopping" if verb == "stop" and found.phase != "Stopped" else found.phase
        emit(found, output, lambda: typer.echo(f"pod {found.name}: {note}"))


@app.command()
def stop(
    pod: str,
    grace: Annotated[float | None, typer.Option(
        help="Seconds between SIGTERM and SIGKILL (default: the node's, 30)", min=0, max=3600,
    )] = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Stop a pod (SIGTERM, then SIGKILL after its grace period)."""
    _action("stop", pod, output, grace)


@app.command()
def start(pod: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Start a stopped or finished pod again."""
    _action("start", pod, output)


@app.command()
def delete(pod: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Delete a pod; a running one is stopped."""
    with cli_errors():
        client().delete_pod(pod)
        emit({"deleted": pod}, output, lambda: typer.echo(f"pod {pod} deleted"))
