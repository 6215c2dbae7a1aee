"""`gpucloud image …`: the images in this node's store (the agent's), for offline use.

An imported image is used by pods whose ``--image`` names the same reference, without
asking any registry (``gpucloud/demo`` is ``docker.io/gpucloud/demo:latest``).
"""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path
from typing import Annotated

import typer

from gpucloud.agent.config import default_state_dir
from gpucloud.cli.common import CliError, OutputFormat, OutputOption, cli_errors, table
from gpucloud.core.errors import InvalidInput
from gpucloud.core.quantities import parse_duration
from gpucloud.images import ImageError, ImageManager, ImageRecord
from gpucloud.images.client import RegistryClient
from gpucloud.images.lazy.mounter import node_lazyfs
from gpucloud.images.lazy.optimize import OptimizedImage, OptimizeOptions, optimize
from gpucloud.images.lazy.record import RecordOptions

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
    """The images in this node's store, with how much of each is local (lazy layers)."""
    state = state_dir or default_state_dir()
    with cli_errors(), ImageManager(state, lazy=node_lazyfs(state)) as manager:
        records = []
        for record in manager.list_images():
            local, total = manager.local_bytes(record)
            records.append({**_record(record), "local": local, "local_of": total})
        if output is OutputFormat.JSON:
            _show(records, output)
            return
        table(["REFERENCE", "DIGEST", "SIZE", "LOCAL", "STORED"],
              [[r["reference"], str(r["digest"])[7:19], _size(int(str(r["size"]))),
                _local(int(str(r["local"])), int(str(r["local_of"]))), r["created_at"]]
               for r in records])


def _local(local: int, total: int) -> str:
    """``100%`` for a pulled image; a lazily mounted one shows how much is cached."""
    return f"{100 * local // total}%" if total else "-"


@app.command("optimize")
def optimize_cmd(
    src: Annotated[str, typer.Argument(help="Image reference, or ./path of an OCI layout")],
    dst: Annotated[str, typer.Argument(help="Where to push it (reference, or ./layout dir)")],
    command: Annotated[list[str] | None, typer.Argument(
        help="With --record: the command to run (after --), else the image's own")] = None,
    record: Annotated[bool, typer.Option(
        help="Run the image in a container and put the files it opens first")] = False,
    period: Annotated[str, typer.Option(help="How long to record (10s, 1m)")] = "10s",
    wait_on_line: Annotated[str | None, typer.Option(
        help="Stop recording when an output line matches this regex")] = None,
    network: Annotated[bool, typer.Option(
        help="Give the recording container the host's network (default: loopback only)")
    ] = False,
    level: Annotated[int, typer.Option(help="gzip level 0-9 (9: smallest, slowest)")] = 9,
    record_out: Annotated[Path | None, typer.Option(
        help="Write the recorded paths here, one per line")] = None,
    prefetch: Annotated[Path | None, typer.Option(
        help="Also prioritize the paths listed in this file (one per line)")] = None,
    insecure: Annotated[list[str] | None, typer.Option(
        help="A non-loopback registry to reach over plain HTTP (repeatable)")] = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Convert an image to eStargz (lazily pullable) and push it."""
    with cli_errors():
        options = OptimizeOptions(
            level=_level(level), record=_record_options(record, command, period,
                                                        wait_on_line, network),
            prefetch=_prefetch_list(prefetch))
        with RegistryClient(insecure=insecure or ()) as client:
            result = optimize(src, dst, options, client)
        if record_out is not None and result.recording is not None:
            record_out.write_text("".join(p + "\n" for p in result.recording.paths))
        _show_optimized(result, output)


def _level(level: int) -> int:
    if not 0 <= level <= 9:
        raise InvalidInput("level", "must be within 0..9")
    return level


def _record_options(record: bool, command: list[str] | None, period: str,
                    wait_on_line: str | None, network: bool) -> RecordOptions | None:
    if not record:
        if command:
            raise InvalidInput("command", "a command is only run with --record")
        return None
    if wait_on_line is not None:
        try:
            re.compile(wait_on_line)
        except re.error as error:
            raise InvalidInput("wait-on-line", f"not a regular expression: {error}") from None
    return RecordOptions(tuple(command or ()), parse_duration("period", period),
                         wait_on_line, network)


def _prefetch_list(path: Path | None) -> tuple[str, ...]:
    if path is None:
        return ()
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise InvalidInput("prefetch", f"cannot read {path}: {error.strerror}") from None
    return tuple(line.strip() for line in lines if line.strip())


def _show_optimized(result: OptimizedImage, output: OutputFormat) -> None:
    layers = [{"digest": c.digest, "size": c.size, "toc_digest": c.toc_digest,
               "uncompressed_size": c.uncompressed_size, "prioritized": len(p),
               "prefetch_bytes": c.toc.prefetch_end()}
              for c, p in zip(result.layers, result.prioritized, strict=True)]
    if output is OutputFormat.JSON:
        recorded = list(result.recording.paths) if result.recording else None
        stopped_by = result.recording.stopped_by if result.recording else None
        typer.echo(json.dumps({"digest": result.manifest_digest, "layers": layers,
                               "recorded": recorded, "stopped_by": stopped_by}, indent=2))
        return
    typer.echo(f"image {result.manifest_digest}")
    if result.recording is not None:  # "period": --wait-on-line never matched
        typer.echo(f"recorded {len(result.recording.paths)} files "
                   f"(stopped by: {result.recording.stopped_by})")
    table(["LAYER", "SIZE", "PRIORITIZED", "PREFETCH"],
          [[str(x["digest"])[7:19], _size(int(str(x["size"]))), x["prioritized"],
            _size(int(str(x["prefetch_bytes"])))] for x in layers])
