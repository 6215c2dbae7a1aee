"""The `gpucloud` command: one Typer app per noun, mounted here."""

from __future__ import annotations

import sys

import typer

from gpucloud.cli import agent as agent_cli
from gpucloud.cli import bench, gpu, image, job, node, pod, policy, project, server, sim, up
from gpucloud.cli import checkpoint as checkpoint_cli
from gpucloud.cli import endpoint as endpoint_cli
from gpucloud.cli import lazyfs as lazyfs_cli
from gpucloud.cli import price as price_cli
from gpucloud.cli import registry_auth as registry_auth_cli
from gpucloud.cli import spend_limit as spend_limit_cli
from gpucloud.cli import ssh_key as ssh_key_cli
from gpucloud.cli import template as template_cli
from gpucloud.cli import usage as usage_cli
from gpucloud.cli import volume as volume_cli

app = typer.Typer(
    help="gpucloud: a self-hosted GPU cloud.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("up")(up.up)
app.command("server")(server.server)
app.command("agent")(agent_cli.agent)
app.command("lazyfs")(lazyfs_cli.lazyfs)
app.add_typer(server.config_app, name="config")
app.add_typer(project.project_app, name="project")
app.add_typer(project.key_app, name="key")
app.add_typer(node.app, name="node")
app.add_typer(pod.app, name="pod")
app.add_typer(ssh_key_cli.app, name="ssh-key")
app.add_typer(job.app, name="job")
app.add_typer(volume_cli.app, name="volume")
app.add_typer(checkpoint_cli.app, name="checkpoint")
app.add_typer(template_cli.app, name="template")
app.add_typer(endpoint_cli.app, name="endpoint")
app.add_typer(registry_auth_cli.app, name="registry-auth")
app.add_typer(policy.priority_app, name="priority-class")
app.add_typer(policy.quota_app, name="quota")
app.add_typer(price_cli.app, name="price")
app.command("usage")(usage_cli.usage)
app.command("invoice")(usage_cli.invoice)
project.project_app.add_typer(spend_limit_cli.app, name="limit")
app.add_typer(gpu.app, name="gpu")
app.add_typer(image.app, name="image")
app.add_typer(sim.app, name="sim")
app.add_typer(bench.app, name="bench")


def main(argv: list[str] | None = None) -> int:
    """Entry point: usage errors become one line (``error: …``) and a non-zero status."""
    try:
        result = app(args=argv, prog_name="gpucloud", standalone_mode=False)
    except typer.Exit as done:
        return int(done.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return 130
    except typer.TyperException as error:
        message = " ".join(error.format_message().split())
        print(f"error: {message}", file=sys.stderr)
        return error.exit_code
    return result if isinstance(result, int) else 0


def run() -> None:
    """The console script."""
    sys.exit(main())


if __name__ == "__main__":
    run()
