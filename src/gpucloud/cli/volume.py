"""`gpucloud volume …`: network volumes, mounted by pods on any node (--network-volume)."""

from __future__ import annotations

from typing import Annotated

import typer

from gpucloud.cli import resources
from gpucloud.cli.common import OutputFormat, OutputOption
from gpucloud.cli.spec import build_request
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
    resources.say(lambda api: api.create_volume(build_request(
        VolumeCreateRequest, {"name": name, "size": size, "zone": zone})), output,
        lambda volume: f"volume {volume.name} created ({volume.id}): {volume.size}")


@app.command("list")
def list_(output: OutputOption = OutputFormat.TABLE) -> None:
    """List the project's network volumes and the live pods mounting them."""
    resources.list_rows(lambda api: api.list_volumes(), output,
                        ["NAME", "ID", "SIZE", "ZONE", "MOUNTED BY"],
                        lambda v: [v.name, v.id[:12], v.size, v.zone, ", ".join(v.mounted_by)])


@app.command()
def delete(name: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Delete a network volume and its files (refused while a live pod mounts it)."""
    resources.delete(lambda api: api.delete_volume(name), "volume", name, output)
