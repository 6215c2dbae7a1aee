"""`gpucloud checkpoint …`: the committed checkpoints of a pod's --checkpoint-dir."""

from __future__ import annotations

from typing import Annotated

import typer

from gpucloud.cli import resources
from gpucloud.cli.common import OutputFormat, OutputOption, cli_errors, client, emit, fields
from gpucloud.core.checkpoints import CheckpointDetailOut
from gpucloud.core.quantities import format_memory

app = typer.Typer(help="Checkpoints of pods' --checkpoint-dir (kept per pod, last 2).",
                  no_args_is_help=True)
PodArg = Annotated[str, typer.Argument(help="Pod name or id")]


def _cost(seconds: float | None) -> str | None:
    return None if seconds is None else f"{seconds:.2f}s"


@app.command("list")
def list_(pod: PodArg, output: OutputOption = OutputFormat.TABLE) -> None:
    """List a pod's checkpoints, newest first."""
    resources.list_rows(lambda api: api.list_checkpoints(pod), output,
                        ["ID", "ATTEMPT", "SEQ", "STATE", "SIZE", "SENT", "FILES", "COST",
                         "NODE", "CREATED"],
                        lambda c: [c.id[:12], c.attempt, c.seq, c.state,
                                   format_memory(c.size_bytes), format_memory(c.bytes_sent),
                                   c.files, _cost(c.cost_seconds), c.node,
                                   c.created_at.isoformat(timespec="seconds")])


def _show(checkpoint: CheckpointDetailOut) -> None:
    fields([
        ("id", checkpoint.id), ("pod", checkpoint.pod), ("key", checkpoint.key),
        ("attempt", checkpoint.attempt), ("seq", checkpoint.seq), ("state", checkpoint.state),
        ("size", format_memory(checkpoint.size_bytes)), ("files", checkpoint.files),
        ("chunks", checkpoint.chunks), ("sent", format_memory(checkpoint.bytes_sent)),
        ("cost", _cost(checkpoint.cost_seconds)), ("node", checkpoint.node),
        ("created", checkpoint.created_at.isoformat(timespec="seconds")),
    ])
    for entry in checkpoint.manifest.entries:
        size = format_memory(entry.size) if entry.kind == "file" else entry.kind
        typer.echo(f"  {entry.path}  {size}")


@app.command()
def get(pod: PodArg,
        checkpoint: Annotated[str, typer.Argument(help="Checkpoint id")] = "latest",
        output: OutputOption = OutputFormat.TABLE) -> None:
    """Show a checkpoint (default: the pod's latest committed one) and its files."""
    resources.show(lambda api: api.get_checkpoint(pod, checkpoint), output, _show)


@app.command()
def delete(pod: PodArg,
           checkpoint: Annotated[str | None, typer.Argument(
               help="Checkpoint id (default: all of the pod's)")] = None,
           output: OutputOption = OutputFormat.TABLE) -> None:
    """Delete one checkpoint of a pod, or all of them."""
    with cli_errors():
        count = client().delete_checkpoints(pod, checkpoint)
        emit({"deleted": count}, output,
             lambda: typer.echo(f"deleted {count} checkpoint(s) of pod {pod}"))
