"""`gpucloud registry-auth …`: logins for private registries, used to pull the images of
pods and templates that name them (`--registry-auth NAME`)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from gpucloud.cli import resources
from gpucloud.cli.common import CliError, OutputFormat, OutputOption, cli_errors, client, emit
from gpucloud.cli.spec import build_request
from gpucloud.core.spec import RegistryAuthAddRequest

app = typer.Typer(help="Registry credentials for pulling private images.",
                  no_args_is_help=True)


@app.command()
def add(
    name: Annotated[str, typer.Argument(help="A name for these credentials (a DNS label)")],
    username: Annotated[str, typer.Option(help="Registry user name")],
    password_stdin: Annotated[bool, typer.Option(
        "--password-stdin", help="Read the password (or token) from standard input")] = False,
    registry: Annotated[str | None, typer.Option(
        help="Registry host they are for (ghcr.io, 127.0.0.1:5000); default: the image's")
    ] = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Add credentials: echo "$TOKEN" | gpucloud registry-auth add NAME --username U
    --password-stdin [--registry HOST]"""
    with cli_errors():
        if not password_stdin:
            raise CliError("--password-stdin is required (a password is never an argument)")
        password = sys.stdin.read().rstrip("\r\n")
        body = {"name": name, "username": username, "password": password}
        if registry is not None:
            body["registry"] = registry
        added = client().add_registry_auth(build_request(RegistryAuthAddRequest, body))
        emit(added, output, lambda: typer.echo(f"registry auth {added.name} added"))


@app.command("list")
def list_(output: OutputOption = OutputFormat.TABLE) -> None:
    """List the project's registry credentials (passwords are never shown)."""
    resources.list_rows(lambda api: api.list_registry_auths(), output,
                        ["NAME", "USERNAME", "REGISTRY", "CREATED"],
                        lambda a: [a.name, a.username, a.registry or "(the image's)",
                                   a.created_at.isoformat(timespec="seconds")])


@app.command()
def remove(name: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """Remove credentials; pods that named them pull without from then on."""
    resources.delete(lambda api: api.remove_registry_auth(name), "registry auth", name, output,
                     verb="removed")
