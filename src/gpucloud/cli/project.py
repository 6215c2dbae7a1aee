"""`gpucloud project …` and `gpucloud key …`: tenants and API keys."""

from __future__ import annotations

from typing import Annotated

import typer

from gpucloud.cli.common import OutputFormat, OutputOption, cli_errors, client, emit, table

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
    with cli_errors():
        items = client().list_projects()
        emit(items, output, lambda: table(
            ["NAME", "ID", "ADMIN", "CREATED"],
            [[p.name, p.id, "yes" if p.is_admin else "", p.created_at.isoformat(timespec="seconds")]
             for p in items],
        ))


@key_app.command("create")
def create_key(name: Annotated[str, typer.Option(help="A name for the key")] = "default",
               output: OutputOption = OutputFormat.TABLE) -> None:
    """Create an API key for your project; it is shown once."""
    with cli_errors():
        created = client().create_key(name)
        emit(created, output, lambda: typer.echo(created.key))


@key_app.command("list")
def list_keys(output: OutputOption = OutputFormat.TABLE) -> None:
    """List your project's keys (never their values)."""
    with cli_errors():
        items = client().list_keys()
        emit(items, output, lambda: table(
            ["ID", "NAME", "PREFIX", "CREATED", "REVOKED"],
            [[k.id, k.name, k.prefix + "…", k.created_at.isoformat(timespec="seconds"),
              k.revoked_at.isoformat(timespec="seconds") if k.revoked_at else ""] for k in items],
        ))


@key_app.command("revoke")
def revoke_key(key: Annotated[str, typer.Argument(help="Key id, name or prefix")],
               output: OutputOption = OutputFormat.TABLE) -> None:
    """Revoke a key at once."""
    with cli_errors():
        revoked = client().revoke_key(key)
        emit(revoked, output, lambda: typer.echo(f"key {revoked.name} ({revoked.id}) revoked"))
