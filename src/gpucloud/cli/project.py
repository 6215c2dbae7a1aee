"""`gpucloud project …` and `gpucloud key …`: tenants and API keys."""

from __future__ import annotations

from typing import Annotated

import typer

from gpucloud.cli import resources
from gpucloud.cli.common import OutputFormat, OutputOption, cli_errors, client, emit

project_app = typer.Typer(help="Projects (tenants).", no_args_is_help=True)
key_app = typer.Typer(help="API keys of your project.", no_args_is_help=True)


@project_app.command()
def create(name: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Create a project and its first API key (admin only)."""
    with cli_errors():
        created = client().create_project(name)
        emit(created, output, lambda: typer.echo(
            f"project {created.project.name} created ({created.project.id})\n"
            f"api key (shown once): {created.key.key}"
        ))


@project_app.command("list")
def list_projects(output: OutputOption = OutputFormat.TABLE) -> None:
    """List projects (admin: all; others: their own)."""
    resources.list_rows(lambda api: api.list_projects(), output,
                        ["NAME", "ID", "ADMIN", "CREATED"],
                        lambda p: [p.name, p.id, "yes" if p.is_admin else "",
                                   p.created_at.isoformat(timespec="seconds")])


@key_app.command("create")
def create_key(name: Annotated[str, typer.Option(help="A name for the key")] = "default",
               output: OutputOption = OutputFormat.TABLE) -> None:
    """Create an API key for your project; it is shown once."""
    resources.say(lambda api: api.create_key(name), output, lambda created: created.key)


@key_app.command("list")
def list_keys(output: OutputOption = OutputFormat.TABLE) -> None:
    """List your project's keys (never their values)."""
    resources.list_rows(lambda api: api.list_keys(), output,
                        ["ID", "NAME", "PREFIX", "CREATED", "REVOKED"],
                        lambda k: [k.id, k.name, k.prefix + "…",
                                   k.created_at.isoformat(timespec="seconds"),
                                   k.revoked_at.isoformat(timespec="seconds")
                                   if k.revoked_at else ""])


@key_app.command("revoke")
def revoke_key(key: Annotated[str, typer.Argument(help="Key id, name or prefix")],
               output: OutputOption = OutputFormat.TABLE) -> None:
    """Revoke a key at once."""
    resources.say(lambda api: api.revoke_key(key), output,
                  lambda revoked: f"key {revoked.name} ({revoked.id}) revoked")
