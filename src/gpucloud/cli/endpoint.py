"""`gpucloud endpoint …`: serverless endpoints (workers scaled with their request queue;
clients call RunPod's /v2/{endpoint}/run, see docs/serverless.md)."""

from __future__ import annotations

import shlex
from typing import Annotated, Any

import typer

from gpucloud.cli import resources
from gpucloud.cli.common import (
    CliError,
    OutputFormat,
    OutputOption,
    cli_errors,
    client,
    emit,
    fields,
)
from gpucloud.cli.spec import (
    GPUS_PORTS,
    SPEC,
    SpecOption,
    SpecValues,
    build_request,
    spec_options,
)
from gpucloud.core.serverless import EndpointCreateRequest, EndpointOut, EndpointUpdateRequest

app = typer.Typer(help="Serverless endpoints: a worker image scaled with its request queue.",
                  no_args_is_help=True)



def _option(param: str, kind: Any, help_text: str) -> SpecOption:
    """An endpoint option that sets the request field of its own name."""
    return SpecOption(param, Annotated[kind, typer.Option(help=help_text)], param)


#: An endpoint's own options (next to the container spec), for `create` and `update` alike;
#: like the spec's, only those given reach the request.
ENDPOINT = (
    _option("template", str | None,
            "Start from this template; the options given here override it"),
    _option("gpu_ids", str | None,
            "RunPod GPU pools, comma-separated: AMPERE_16, AMPERE_24, ADA_24, AMPERE_48, "
            "ADA_48_PRO, AMPERE_80, ADA_80_PRO, HOPPER_141"),
    _option("min_workers", int | None, "Workers kept running (default 0)"),
    _option("max_workers", int | None, "Most workers (default 3)"),
    _option("idle_timeout", str | None, "Stop a worker idle this long: 5s (default), 2m"),
    _option("scaler", str | None,
            "queue-delay (default: add a worker when a request waited --scaler-value s) or "
            "request-count (a worker per --scaler-value requests)"),
    _option("scaler_value", int | None, "The scaler's value (default 4)"),
    _option("execution_timeout", str | None,
            "A request running longer is TIMED_OUT: 600s (default), 1h"),
    _option("max_retries", int | None,
            "Times a request is retried when its worker is lost (default 3)"),
)


def _show(endpoint: EndpointOut) -> None:
    fields([
        ("id", endpoint.id), ("name", endpoint.name), ("image", endpoint.image),
        ("template", endpoint.template),
        ("command", shlex.join(endpoint.command)),
        ("gpus", f"{endpoint.gpus:g}" + (f" x {endpoint.gpu_type}" if endpoint.gpu_type
                                         else "")),
        ("gpu pools", endpoint.gpu_ids), ("cpu", f"{endpoint.cpu:g}"),
        ("memory", endpoint.memory),
        ("env", ", ".join(f"{k}={v}" for k, v in endpoint.env.items())),
        ("workers", f"{endpoint.workers} running ({endpoint.workers_idle} idle), "
                    f"{endpoint.min_workers}..{endpoint.max_workers}"),
        ("queue", str(endpoint.queue)),
        ("scaler", f"{endpoint.scaler} {endpoint.scaler_value}"),
        ("idle timeout", f"{endpoint.idle_timeout_seconds:g}s"),
        ("execution timeout", f"{endpoint.execution_timeout_seconds:g}s"),
        ("max retries", str(endpoint.max_retries)),
        ("created", endpoint.created_at.isoformat(timespec="seconds")),
    ])


@app.command()
@spec_options(*ENDPOINT, *SPEC, *GPUS_PORTS)
def create(
    name: Annotated[str, typer.Argument(help="Endpoint name (a DNS label)")],
    output: OutputOption = OutputFormat.TABLE,
    *,
    spec: SpecValues,
) -> None:
    """Create an endpoint: gpucloud endpoint create NAME --image IMAGE [--gpus N]
    [--min-workers 0] [--max-workers 5] [--idle-timeout 5s] [--scaler queue-delay
    --scaler-value N] [--execution-timeout 600s] -- CMD"""
    with cli_errors():
        if "template" not in spec and "image" not in spec:
            raise CliError("--image is required (or --template)")
        made = client().create_endpoint(
            build_request(EndpointCreateRequest, {"name": name, **spec}))
        emit(made, output, lambda: typer.echo(f"endpoint {made.name} created ({made.id})"))


@app.command("list")
def list_(output: OutputOption = OutputFormat.TABLE) -> None:
    """List the project's endpoints."""
    resources.list_rows(lambda api: api.list_endpoints(), output,
                        ["NAME", "ID", "IMAGE", "GPUS", "WORKERS", "QUEUE"],
                        lambda e: [e.name, e.id, e.image, f"{e.gpus:g}",
                                   f"{e.workers}/{e.min_workers}..{e.max_workers}",
                                   str(e.queue)])


@app.command()
def get(endpoint: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Show one endpoint (by name or id), with its workers running now and its queue."""
    resources.show(lambda api: api.get_endpoint(endpoint), output, _show)


@app.command()
@spec_options(*ENDPOINT, *SPEC, *GPUS_PORTS)
def update(
    endpoint: Annotated[str, typer.Argument(help="Endpoint name or id")],
    output: OutputOption = OutputFormat.TABLE,
    *,
    spec: SpecValues,
) -> None:
    """Change an endpoint: only the options given change; workers started from now on
    get the new spec."""
    with cli_errors():
        if not spec:
            raise CliError("nothing to change: give at least one option")
        changed = client().update_endpoint(endpoint, build_request(EndpointUpdateRequest,
                                                                   spec))
        emit(changed, output, lambda: typer.echo(f"endpoint {changed.name} updated"))


@app.command()
def delete(endpoint: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Delete an endpoint: its queued and running requests are cancelled, its workers
    deleted."""
    resources.delete(lambda api: api.delete_endpoint(endpoint), "endpoint", endpoint, output)
