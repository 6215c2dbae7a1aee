"""`gpucloud template …`: named container specs that pods are created from
(`gpucloud pod create NAME --template T`)."""

from __future__ import annotations

import shlex
from typing import Annotated

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
from gpucloud.cli.spec import GPUS_PORTS, SPEC, SpecValues, build_request, spec_options
from gpucloud.core.quantities import format_memory
from gpucloud.core.spec import TemplateCreateRequest, TemplateOut

app = typer.Typer(help="Pod templates: an image and its settings, under a name.",
                  no_args_is_help=True)


def _size(value: int | None) -> str | None:
    return None if value is None else format_memory(value)


def _show(template: TemplateOut) -> None:
    fields([
        ("id", template.id), ("name", template.name), ("image", template.image),
        ("entrypoint", None if template.entrypoint is None
         else shlex.join(template.entrypoint) or '""'),
        ("command", shlex.join(template.command)),
        ("gpus", f"{template.gpus:g}" + (f" x {template.gpu_type}" if template.gpu_type else "")),
        ("cpu", f"{template.cpu:g}"), ("memory", template.memory),
        ("env", ", ".join(f"{k}={v}" for k, v in template.env.items())),
        ("ports", ", ".join(template.ports)),
        ("volume", f"{_size(template.volume_size)} at {template.volume_path or '/workspace'}"
         if template.volume_size else None),
        ("container disk", _size(template.container_disk)),
        ("network volumes", ", ".join(template.network_volumes)),
        ("registry auth", template.registry_auth),
        ("created", template.created_at.isoformat(timespec="seconds")),
    ])


@app.command()
@spec_options(*SPEC, *GPUS_PORTS)
def create(
    name: Annotated[str, typer.Argument(help="Template name (a DNS label)")],
    output: OutputOption = OutputFormat.TABLE,
    *,
    spec: SpecValues,
) -> None:
    """Create a template: gpucloud template create NAME --image IMAGE [options] -- CMD"""
    with cli_errors():
        if "image" not in spec:
            raise CliError("--image is required")
        made = client().create_template(
            build_request(TemplateCreateRequest, {"name": name, **spec}))
        emit(made, output, lambda: typer.echo(f"template {made.name} created ({made.id})"))


@app.command("list")
def list_(output: OutputOption = OutputFormat.TABLE) -> None:
    """List the project's templates."""
    resources.list_rows(lambda api: api.list_templates(), output,
                        ["NAME", "IMAGE", "GPUS", "PORTS", "VOLUME"],
                        lambda t: [t.name, t.image, f"{t.gpus:g}", ",".join(t.ports),
                                   _size(t.volume_size)])


@app.command()
def get(template: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Show one template (by name or id)."""
    resources.show(lambda api: api.get_template(template), output, _show)


@app.command()
def delete(template: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Delete a template; pods created from it keep their settings."""
    resources.delete(lambda api: api.delete_template(template), "template", template, output)
