"""`gpucloud image …`: the images in this node's store (the agent's), for offline use.

An imported image is used by pods whose ``--image`` names the same reference, without
asking any registry (``gpucloud/demo`` is ``docker.io/gpucloud/demo:latest``).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Annotated

import typer

from gpucloud.agent.config import default_state_dir
from gpucloud.cli.common import CliError, OutputFormat, OutputOption, cli_errors, table
from gpucloud.images import ImageError, ImageManager, ImageRecord

app = typer.Typer(help="Images in this node's image store.", no_args_is_help=True)

StateDirOption = Annotated[Path | None, typer.Option(
    help="The agent's state directory (default: $GPUCLOUD_HOME/agent)")]


def _record(record: ImageRecord) -> dict[str, object]:
    return {"reference": record.reference, "digest": record.manifest_digest,
            "config_digest": record.config_digest, "size": record.size,
            "created_at": datetime.datetime.fromtimestamp(record.created_at, datetime.UTC)
            .isoformat(timespec="seconds")}


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:.1f} MB" if num_bytes >= 100_000 else f"{num_bytes / 1e3:.1f} kB"


def _show(records: list[dict[str, object]], output: OutputFormat) -> None:
    """A list of JSON objects, or a table (sizes are the compressed layers')."""
    if output is OutputFormat.JSON:
        typer.echo(json.dumps(records, indent=2))
        return
    table(["REFERENCE", "DIGEST", "SIZE", "STORED"],
          [[r["reference"], str(r["digest"])[7:19], _size(int(str(r["size"]))),
            r["created_at"]] for r in records])


@app.command("import")
def import_(
    file: Annotated[Path, typer.Argument(help="An OCI layout (dir or tar) or docker save tar",
                                         exists=True)],
    name: Annotated[str | None, typer.Option(
        help="Reference to store it under (needed when the archive names none)")] = None,
    state_dir: StateDirOption = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Import an image archive into this node's store."""
    with cli_errors(), ImageManager(state_dir or default_state_dir()) as manager:
        try:
            images = manager.import_archive(file, name)
        except ImageError as error:  # some carry a multi-line cause (tarfile's)
            raise CliError(" ".join(error.message.split())) from None
        records = {r.reference: r for r in manager.list_images()}
        imported = [_record(records[i.reference]) for i in images if i.reference in records]
        _show(imported, output)


@app.command("list")
def list_(state_dir: StateDirOption = None, output: OutputOption = OutputFormat.TABLE) -> None:
    """The images in this node's store."""
    with cli_errors(), ImageManager(state_dir or default_state_dir()) as manager:
        records = [_record(r) for r in manager.list_images()]
        _show(records, output)
