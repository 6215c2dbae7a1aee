"""`gpucloud volume …`: network volumes, mounted by pods on any node (--network-volume)."""

from __future__ import annotations

from typing import Annotated

import typer
from pydantic import ValidationError

from gpucloud.cli.common import (
    CliError,
    OutputFormat,
    OutputOption,
    cli_errors,
    client,
    emit,
    table,
    validation_message,
)
from gpucloud.core.access import VolumeCreateRequest

app = typer.Typer(help="Network volumes: files that pods on several nodes share.",
                  no_args_is_help=True)


@app.command()
def create(
    name: Annotated[str, typer.Argument(help="Volume name (a DNS label), unique in the project")],
    size: Annotated[str, typer.Option(help="Size: 100Gi, 1Ti …")],
    zone: Annotated[str | None, typer.Option(help="The zone its pods run in")] = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Create a network volume: gpucloud volume create NAME --size 100Gi [--zone Z]"""
    with cli_errors():
        try:
            request = VolumeCreateRequest(name=name, size=size, zone=zone)
        except ValidationError as error:
            raise CliError(validation_message(error)) from None
        volume = client().create_volume(request)
        emit(volume, output, lambda: typer.echo(
            f"volume {volume.name} created ({volume.id}): {volume.size}"))


@app.command("list")
def list_(output: OutputOption = OutputFormat.TABLE) -> None:
    """List the project's network volumes and the live pods mounting them."""
    with cli_errors():
        volumes = client().list_volumes()
        emit(volumes, output, lambda: table(
            ["NAME", "ID", "SIZE", "ZONE", "MOUNTED BY"],
            [[v.name, v.id[:12], v.size, v.zone, ", ".join(v.mounted_by)] for v in volumes],
        ))


@app.command()
def delete(name: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Delete a network volume and its files (refused while a live pod mounts it)."""
    with cli_errors():
        client().delete_volume(name)
        emit({"deleted": name}, output, lambda: typer.echo(f"volume {name} deleted"))
