"""`gpucloud node …`: the fleet; join tokens for new nodes."""

from __future__ import annotations

from typing import Annotated

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
        ("drain", _drain_summary(node)),
        ("mig policy", node.mig_policy),
        ("mig-capable gpus", sum(1 for gpu in node.gpus if gpu.mig_capable)),
    ])
    for gpu in node.gpus:
        peers = ",".join(map(str, gpu.nvlink_peers)) or "-"
        typer.echo(f"  gpu {gpu.index}: {gpu.model} {gpu.memory_mib} MiB numa {gpu.numa_node} "
                   f"nvlink [{peers}] {gpu.uuid}")
        for mig in gpu.mig_instances:
            typer.echo(f"    mig {mig.profile} slot {mig.slot}: {mig.mig_uuid}")


def _volume_mode(mode: str | None) -> str:
    """How the node mounts network volumes, said plainly."""
    if mode == "nfs":
        return "nfs (mounts the server's export of its volumes directory)"
    if mode == "hostpath":
        return "hostpath (binds the server's volumes directory: same machine)"
    return "unknown (an older agent: hostpath)"


join_tokens = typer.Typer(help="Join tokens for new nodes.")
app.add_typer(join_tokens, name="join-token")


@join_tokens.callback(invoke_without_command=True)
def join_token(
    context: typer.Context,
    uses: Annotated[int | None, typer.Option(
        min=1, help="Registrations it allows (1: single-use); default any until it expires")
    ] = None,
    ttl: Annotated[float | None, typer.Option(
        "--ttl", min=60, help="Seconds it stays valid (default: the server's, 24 h)")] = None,
) -> None:
    """Print a new join token (alone on stdout) for `gpucloud agent --join-token`;
    `list` and `revoke ID` manage the existing ones."""
    if context.invoked_subcommand is not None:
        return
    with cli_errors():
        typer.echo(client().create_join_token(uses=uses, ttl_seconds=ttl).token)


@join_tokens.command("list")
def list_join_tokens(output: OutputOption = OutputFormat.TABLE) -> None:
    """Join tokens: prefix, uses, expiry, revocation (never their values)."""
    with cli_errors():
        tokens = client().list_join_tokens()
        emit(tokens, output, lambda: table(
            ["ID", "PREFIX", "USES", "EXPIRES", "REVOKED"],
            [[t.id, t.prefix or "-", f"{t.uses}/{t.max_uses if t.max_uses else 'any'}",
              t.expires_at.isoformat(timespec="seconds"),
              t.revoked_at.isoformat(timespec="seconds") if t.revoked_at else "no"]
             for t in tokens]))


@join_tokens.command("revoke")
def revoke_join_token(token: Annotated[str, typer.Argument(help="id or printed prefix")],
                      output: OutputOption = OutputFormat.TABLE) -> None:
    """Refuse a join token from now on (nodes it registered keep working)."""
    with cli_errors():
        revoked = client().revoke_join_token(token)
        emit(revoked, output, lambda: typer.echo(f"join token {revoked.prefix or revoked.id} "
                                                 "revoked"))


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


@app.command()
def mig(node: str,
        mode: Annotated[str, typer.Option(help="dynamic (make MIG instances as pods are "
                                          "placed), fixed (use the node's own layout) or "
                                          "off (no MIG pods)")],
        output: OutputOption = OutputFormat.TABLE) -> None:
    """Set a node's MIG policy (switching a GPU's MIG mode stays a drain-time admin step)."""
    with cli_errors():
        found = client().set_mig_policy(node, mode)
        emit(found, output, lambda: typer.echo(f"node {found.name} mig policy {found.mig_policy}"))


def _drain_summary(node: NodeOut) -> str | None:
    """``draining: 2 of 3 pods left (a, b), deadline …`` — the drain's progress."""
    drain = node.drain
    if drain is None:
        return None
    if drain.state == "waiting":
        return "waiting for another node's drain to end (cordoned)"
    left = f"{drain.pods_left} of {drain.pods_total} pods left"
    if drain.pods:
        left += f" ({', '.join(drain.pods)})"
    deadline = drain.deadline.isoformat(timespec="seconds") if drain.deadline else "-"
    if drain.state == "drained":
        ended = drain.finished_at.isoformat(timespec="seconds") if drain.finished_at else ""
        return f"drained at {ended}; {drain.pods_total} pods moved"
    return f"draining: {left}, deadline {deadline}"


@app.command()
def drain(node: str, deadline: Annotated[str | None, typer.Option(
        help="After this long (60s, 10m; default 10m) what still runs there is stopped")] = None,
          output: OutputOption = OutputFormat.TABLE) -> None:
    """Move every pod off a node: cordon, notice (checkpoint, SIGTERM), restart elsewhere;
    the node is Drained once empty."""
    with cli_errors():
        found = client().drain(node, deadline)
        emit(found, output, lambda: typer.echo(
            f"node {found.name} {found.status}: {_drain_summary(found)}"))


@app.command()
def undrain(node: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """End a node's drain and place pods on it again."""
    with cli_errors():
        found = client().undrain(node)
        emit(found, output, lambda: typer.echo(f"node {found.name} undrained ({found.status})"))
