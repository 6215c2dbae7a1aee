"""`gpucloud pod …`: create, inspect, follow and control pods."""

from __future__ import annotations

import shlex
from typing import Annotated

import typer

from gpucloud.cli import pod_access, resources
from gpucloud.cli.common import (
    EVENT_TIME_FORMAT,
    CliError,
    OutputFormat,
    OutputOption,
    cli_errors,
    client,
    emit,
    fields,
)
from gpucloud.cli.spec import GPUS_PORTS, SCHEDULING, SPEC, SpecValues, build_request, spec_options
from gpucloud.core.models import PodCreateRequest, PodOut
from gpucloud.core.quantities import format_memory

app = typer.Typer(help="GPU pods: containers with GPUs.", no_args_is_help=True)
#: How long each waiting read of ``logs --follow`` is held (the API's longest).
FOLLOW_WAIT_SECONDS = 30.0
app.command("exec")(pod_access.exec_)
app.command("ssh")(pod_access.ssh)


def _port_map(pod: PodOut) -> str | None:
    """RunPod's ``runtime.ports`` in one line: ``10.0.0.2:8000/tcp, 127.0.0.1:40001->8000``."""
    shown = [f"{p.ip}:{p.publicPort}->{p.privatePort}/{p.type}" if p.isIpPublic
             else f"{p.ip}:{p.privatePort}/{p.type}" for p in pod.ports_runtime]
    return ", ".join(shown) or None


def _mig_summary(pod: PodOut) -> str | None:
    """``3g.40gb at slot 4 of GPU-… : MIG-…`` (the slot alone until the node reports)."""
    if pod.mig is None:
        return None
    device = pod.mig_device
    if device is None:
        slot = f" at slot {pod.mig_slot}" if pod.mig_slot is not None else ""
        return f"{pod.mig}{slot} (no MIG device yet)"
    return f"{device.profile} at slot {device.slot} of {device.gpu_uuid}: {device.mig_uuid}"


def _show_pod(pod: PodOut) -> None:
    fields([
        ("id", pod.id), ("name", pod.name), ("project", pod.project), ("phase", pod.phase),
        ("reason", pod.reason), ("message", pod.message), ("node", pod.node),
        ("image", pod.image), ("template", pod.template),
        ("entrypoint", None if pod.entrypoint is None else shlex.join(pod.entrypoint) or '""'),
        ("command", " ".join(pod.command)), ("registry auth", pod.registry_auth),
        ("gpus", f"{pod.gpus:g}" + (f" x {pod.gpu_type}" if pod.gpu_type else "")),
        ("gpu uuids", ", ".join(pod.gpu_uuids)), ("mig", _mig_summary(pod)),
        ("cpu", f"{pod.cpu:g}"),
        ("memory", pod.memory), ("env", ", ".join(f"{k}={v}" for k, v in pod.env.items())),
        ("ports", ", ".join(pod.ports)), ("ip", pod.ip),
        ("port map", _port_map(pod)), ("restart", pod.restart.value),
        ("restarts", pod.restart_count), ("exit code", pod.exit_code),
        ("spot", f"yes (bid {pod.bid:g})" if pod.spot and pod.bid else
         "yes" if pod.spot else None),
        ("preemptions", f"{pod.preemptions} (last: {pod.last_preemption_reason}; "
         f"time lost {pod.time_lost_seconds:.0f}s)" if pod.preemptions else None),
        ("max duration", f"{pod.max_duration:g}s" if pod.max_duration else None),
        ("volume", f"{format_memory(pod.volume_size)} at {pod.volume_path} on node "
                   f"{pod.volume_node or '(not placed yet)'}" if pod.volume_size else None),
        ("container disk",
         format_memory(pod.container_disk) if pod.container_disk else None),
        ("network volumes", ", ".join(pod.network_volumes) or None),
        ("checkpoint dir", pod.checkpoint_dir),
        ("last checkpoint", f"{pod.last_checkpoint.id[:12]} at "
         f"{pod.last_checkpoint.time.isoformat(timespec='seconds')} "
         f"({format_memory(pod.last_checkpoint.size_bytes)})" if pod.last_checkpoint else None),
        ("created", pod.created_at.isoformat(timespec="seconds")),
    ])


@app.command()
@spec_options(*SPEC, *GPUS_PORTS, *SCHEDULING)
def create(
    name: Annotated[str, typer.Argument(help="Pod name (a DNS label), unique in the project")],
    template: Annotated[str | None, typer.Option(
        help="Start from this template; the options given here override it")] = None,
    restart: Annotated[str | None, typer.Option(
        help="never (default), on-failure or always")] = None,
    output: OutputOption = OutputFormat.TABLE,
    *,
    spec: SpecValues,
) -> None:
    """Create a pod: gpucloud pod create NAME --image IMAGE [--gpus N] -- COMMAND [ARGS...]

    or from a template: gpucloud pod create NAME --template T [--gpus N …]"""
    with cli_errors():
        if template is None and "image" not in spec:
            raise CliError("--image is required (or --template)")
        extra = {"template": template, "restart": restart}
        body = {"name": name, **spec, **{k: v for k, v in extra.items() if v is not None}}
        pod = client().create_pod(build_request(PodCreateRequest, body))
        emit(pod, output, lambda: typer.echo(f"pod {pod.name} created ({pod.id}): {pod.phase}"))


@app.command("list")
def list_(phase: Annotated[str | None, typer.Option(help="Only pods in this phase")] = None,
          output: OutputOption = OutputFormat.TABLE) -> None:
    """List the project's pods."""
    resources.list_rows(lambda api: api.list_pods(phase), output,
                        ["NAME", "ID", "PHASE", "NODE", "GPUS", "IMAGE", "REASON"],
                        lambda p: [p.name, p.id[:12], p.phase, p.node, f"{p.gpus:g}", p.image,
                                   p.reason])


@app.command()
def get(pod: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Show one pod (by id or name)."""
    resources.show(lambda api: api.get_pod(pod), output, _show_pod)


@app.command()
def events(pod: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """The pod's phase changes, with times and reasons."""
    resources.list_rows(lambda api: api.pod_events(pod), output,
                        ["TIME", "FROM", "TO", "REASON", "MESSAGE"],
                        lambda e: [e.time.strftime(EVENT_TIME_FORMAT), e.from_phase, e.to_phase,
                                   e.reason, e.message])


@app.command()
def why(pod: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Why a pod is pending: how many nodes were rejected for each reason."""
    resources.say(lambda api: api.pod_why(pod), output, lambda answer: answer.summary)


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
        if output is OutputFormat.JSON:
            emit(api.pod_logs(pod, tail=tail), output, lambda: None)
            return
        if not follow:
            typer.echo(api.pod_logs(pod, tail=tail).text, nl=False)
            return
        # Waiting reads: each new piece is printed as soon as the server has it.
        for chunk in api.follow_pod_logs(pod, tail=tail, wait=FOLLOW_WAIT_SECONDS):
            typer.echo(chunk.text, nl=False)


def _action(verb: str, pod: str, output: OutputFormat, grace: float | None = None,
            gpus: float | None = None, migrate: bool = False) -> None:
    with cli_errors():
        api = client()
        found = (api.stop_pod(pod, grace) if verb == "stop"
                 else api.start_pod(pod, gpus, migrate))
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
def start(
    pod: str,
    gpus: Annotated[float | None, typer.Option(
        help="GPUs from this start on; 0 starts it without GPUs, to reach its volume")
    ] = None,
    migrate: Annotated[bool, typer.Option(
        "--migrate", help="Start on any node with room: its volume disk is copied there "
                          "from the node holding it (checked by sha256)")] = False,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Start a stopped or finished pod again (on the node holding its volume disk)."""
    _action("start", pod, output, gpus=gpus, migrate=migrate)


@app.command()
def delete(pod: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Delete a pod; a running one is stopped."""
    resources.delete(lambda api: api.delete_pod(pod), "pod", pod, output)
