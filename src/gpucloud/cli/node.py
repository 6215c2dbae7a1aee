"""`gpucloud node …`: the fleet; join tokens for new nodes."""

from __future__ import annotations

import typer

from gpucloud.cli.common import OutputFormat, OutputOption, cli_errors, client, emit, fields, table
from gpucloud.core.models import NodeOut
from gpucloud.core.quantities import format_memory

app = typer.Typer(help="GPU nodes.", no_args_is_help=True)


def _gpu_summary(node: NodeOut) -> str:
    models: dict[str, int] = {}
    for gpu in node.gpus:
        models[gpu.model] = models.get(gpu.model, 0) + 1
    return ", ".join(f"{n}x {m}" for m, n in models.items()) or "none"


def _show(node: NodeOut) -> None:
    fields([
        ("id", node.id), ("name", node.name), ("status", node.status),
        ("cordoned", node.cordoned), ("address", node.address), ("provider", node.provider),
        ("cpu", f"{node.cpu_cores:g}"), ("memory", format_memory(node.memory_bytes)),
        ("gpus", _gpu_summary(node)), ("gpus allocated", node.gpus_allocated),
        ("labels", ", ".join(f"{k}={v}" for k, v in node.labels.items())),
        ("fencing token", node.fencing_token),
        ("network volumes", _volume_mode(node.volume_mode)),
        ("lease until", node.lease_expires_at.isoformat(timespec="seconds")
         if node.lease_expires_at else None),
    ])
    for gpu in node.gpus:
        peers = ",".join(map(str, gpu.nvlink_peers)) or "-"
        typer.echo(f"  gpu {gpu.index}: {gpu.model} {gpu.memory_mib} MiB numa {gpu.numa_node} "
                   f"nvlink [{peers}] {gpu.uuid}")


def _volume_mode(mode: str | None) -> str:
    """How the node mounts network volumes, said plainly."""
    if mode == "nfs":
        return "nfs (mounts the server's export of its volumes directory)"
    if mode == "hostpath":
        return "hostpath (binds the server's volumes directory: same machine)"
    return "unknown (an older agent: hostpath)"


@app.command("join-token")
def join_token() -> None:
    """Print a new join token (alone on stdout) for `gpucloud agent --join-token`."""
    with cli_errors():
        typer.echo(client().create_join_token().token)


@app.command("list")
def list_(output: OutputOption = OutputFormat.TABLE) -> None:
    """List nodes."""
    with cli_errors():
        nodes = client().list_nodes()
        emit(nodes, output, lambda: table(
            ["NAME", "STATUS", "CORDONED", "GPUS", "ALLOCATED", "CPU", "MEMORY", "ADDRESS"],
            [[n.name, n.status, "yes" if n.cordoned else "no", _gpu_summary(n),
              f"{n.gpus_allocated}/{len(n.gpus)}", f"{n.cpu_cores:g}",
              format_memory(n.memory_bytes), n.address] for n in nodes],
        ))


@app.command()
def get(node: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Show one node with its GPUs."""
    with cli_errors():
        found = client().get_node(node)
        emit(found, output, lambda: _show(found))


@app.command()
def cordon(node: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Stop placing new pods on a node (running pods stay)."""
    with cli_errors():
        found = client().cordon(node, True)
        emit(found, output, lambda: typer.echo(f"node {found.name} cordoned"))


@app.command()
def uncordon(node: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Place pods on a node again."""
    with cli_errors():
        found = client().cordon(node, False)
        emit(found, output, lambda: typer.echo(f"node {found.name} uncordoned"))
