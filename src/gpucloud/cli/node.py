"""`gpucloud node …`: the fleet; join tokens for new nodes."""

from __future__ import annotations

import time
from collections.abc import Callable
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
        ("cordon reason", node.cordon_reason),
        ("mig policy", node.mig_policy),
        ("mig-capable gpus", sum(1 for gpu in node.gpus if gpu.mig_capable)),
    ])
    for gpu in node.gpus:
        peers = ",".join(map(str, gpu.nvlink_peers)) or "-"
        health = "" if gpu.healthy else f" UNHEALTHY ({gpu.health_reason or 'checks failed'})"
        typer.echo(f"  gpu {gpu.index}: {gpu.model} {gpu.memory_mib} MiB numa {gpu.numa_node} "
                   f"nvlink [{peers}] {gpu.uuid}{health}")
        if gpu.maintenance is not None:
            typer.echo(f"    {gpu.maintenance.action} {gpu.maintenance.state} "
                       f"(asked {gpu.maintenance.requested_at.isoformat(timespec='seconds')})")
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
    resources.list_rows(lambda api: api.list_join_tokens(), output,
                        ["ID", "PREFIX", "USES", "EXPIRES", "REVOKED"],
                        lambda t: [t.id, t.prefix or "-",
                                   f"{t.uses}/{t.max_uses if t.max_uses else 'any'}",
                                   t.expires_at.isoformat(timespec="seconds"),
                                   t.revoked_at.isoformat(timespec="seconds")
                                   if t.revoked_at else "no"])


@join_tokens.command("revoke")
def revoke_join_token(token: Annotated[str, typer.Argument(help="id or printed prefix")],
                      output: OutputOption = OutputFormat.TABLE) -> None:
    """Refuse a join token from now on (nodes it registered keep working)."""
    resources.say(lambda api: api.revoke_join_token(token), output,
                  lambda revoked: f"join token {revoked.prefix or revoked.id} revoked")


@app.command("list")
def list_(output: OutputOption = OutputFormat.TABLE) -> None:
    """List nodes."""
    resources.list_rows(lambda api: api.list_nodes(), output,
                        ["NAME", "STATUS", "CORDONED", "GPUS", "ALLOCATED", "CPU", "MEMORY",
                         "ADDRESS"],
                        lambda n: [n.name, n.status, "yes" if n.cordoned else "no",
                                   _gpu_summary(n), f"{n.gpus_allocated}/{len(n.gpus)}",
                                   f"{n.cpu_cores:g}", format_memory(n.memory_bytes),
                                   n.address])


@app.command()
def get(node: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Show one node with its GPUs."""
    resources.show(lambda api: api.get_node(node), output, _show)


@app.command()
def cordon(node: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Stop placing new pods on a node (running pods stay)."""
    resources.say(lambda api: api.cordon(node, True), output,
                  lambda found: f"node {found.name} cordoned")


@app.command()
def uncordon(node: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Place pods on a node again."""
    resources.say(lambda api: api.cordon(node, False), output,
                  lambda found: f"node {found.name} uncordoned")


@app.command()
def mig(node: str,
        mode: Annotated[str, typer.Option(help="dynamic (make MIG instances as pods are "
                                          "placed), fixed (use the node's own layout) or "
                                          "off (no MIG pods)")],
        output: OutputOption = OutputFormat.TABLE) -> None:
    """Set a node's MIG policy (a GPU's MIG mode itself: ``node mig-mode``, at drain time)."""
    resources.say(lambda api: api.set_mig_policy(node, mode), output,
                  lambda found: f"node {found.name} mig policy {found.mig_policy}")


#: How the GPU action commands wait for the agent's answer (tests replace ``pause``).
pause: Callable[[float], None] = time.sleep
ACTION_POLL_SECONDS = 0.5


def _maintenance_lines(node: NodeOut, ids: set[str]) -> list[str]:
    """``gpu 3 reset passed: …`` for the GPUs whose maintenance is one of ``ids``."""
    lines = []
    for gpu in node.gpus:
        done = gpu.maintenance
        if done is not None and done.id in ids:
            output = (done.output or "").strip().splitlines()
            lines.append(f"gpu {gpu.index} {done.action} {done.state}"
                         + (f": {output[-1]}" if output else ""))
    return lines


def _run_action(node: str, action: str, gpu: int | None, level: int, wait: float,
                output: OutputFormat, drain_wait: float = 0) -> None:
    """Ask for the action, then wait (up to ``wait`` seconds) for the agent's answer;
    exit 1 when it failed or did not come. ``drain_wait``: how long a MIG switch may wait
    for the GPU's pods to end (server side)."""
    sdk = client()
    asked = sdk.gpu_action(node, action, gpu, level, drain_wait)
    ids = {g.maintenance.id for g in asked.gpus
           if g.maintenance is not None and g.maintenance.state == "requested"}
    found, deadline = asked, time.monotonic() + wait
    while wait > 0 and time.monotonic() < deadline:
        found = sdk.get_node(node)
        states = [g.maintenance.state for g in found.gpus
                  if g.maintenance is not None and g.maintenance.id in ids]
        if "requested" not in states:
            break
        pause(ACTION_POLL_SECONDS)
    emit(found, output, lambda: typer.echo("\n".join(_maintenance_lines(found, ids))))
    final = {str(g.maintenance.state) for g in found.gpus
             if g.maintenance is not None and g.maintenance.id in ids}
    if wait > 0 and final != {"passed"}:
        raise CliError(f"{action} on node {node}: " + (
            "the agent did not answer in time" if "requested" in final else "failed"))


WaitOption = Annotated[float, typer.Option(
    "--wait", min=0, help="Seconds to wait for the agent's answer (0: do not wait)")]


@app.command("gpu-reset")
def gpu_reset(node: str, gpu: Annotated[int, typer.Argument(min=0, help="GPU index")],
              level: Annotated[int, typer.Option(min=1, max=3, help="diag level after the "
                                                 "reset (1 quick, 2 medium)")] = 1,
              wait: WaitOption = 300, output: OutputOption = OutputFormat.TABLE) -> None:
    """Reset an idle GPU and run a diag (nvidia-smi, dcgmi on the node); the GPU is back
    in service when the diag passes."""
    with cli_errors():
        _run_action(node, "reset", gpu, level, wait, output)


@app.command()
def diag(node: str, gpu: Annotated[int | None, typer.Option(min=0, help="GPU index "
                                                            "(default: every GPU)")] = None,
         level: Annotated[int, typer.Option(min=1, max=3, help="1 quick, 2 medium")] = 1,
         wait: WaitOption = 300, output: OutputOption = OutputFormat.TABLE) -> None:
    """Run a diag on a node's GPUs through its agent; a GPU that passes is back in service."""
    with cli_errors():
        _run_action(node, "diag", gpu, level, wait, output)


@app.command("mig-mode")
def mig_mode(node: str, gpu: Annotated[int, typer.Argument(min=0, help="GPU index")],
             on: Annotated[bool, typer.Option("--on/--off", help="MIG mode on or off")],
             wait: Annotated[float, typer.Option(
                 "--wait", min=0, help="Seconds the switch may wait for the GPU's pods to "
                 "end, then for the agent (0: refuse while pods hold the GPU, do not wait)")
             ] = 300,
             output: OutputOption = OutputFormat.TABLE) -> None:
    """Switch a GPU's MIG mode (an admin step at drain time): the GPU leaves scheduling,
    the agent switches it once no pod holds it (it may reset the GPU), and placement
    follows the new mode."""
    with cli_errors():
        _run_action(node, "mig-on" if on else "mig-off", gpu, 1, wait, output,
                    drain_wait=wait)


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
    resources.say(lambda api: api.drain(node, deadline), output,
                  lambda found: f"node {found.name} {found.status}: {_drain_summary(found)}")


@app.command()
def undrain(node: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """End a node's drain and place pods on it again."""
    resources.say(lambda api: api.undrain(node), output,
                  lambda found: f"node {found.name} undrained ({found.status})")
