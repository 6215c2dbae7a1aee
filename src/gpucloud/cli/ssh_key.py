"""`gpucloud ssh-key …`: the SSH public keys that get into the project's pods."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from gpucloud.cli import resources
from gpucloud.cli.common import CliError, OutputFormat, OutputOption
from gpucloud.core.access import SshKeyOut

app = typer.Typer(help="SSH keys: who may ssh into the project's pods.",
                  no_args_is_help=True)


def _read(source: str) -> str:
    if source == "-":
        return sys.stdin.read()
    try:
        return Path(source).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise CliError(f"cannot read {source}: {error}") from None


def _summary(key: SshKeyOut) -> str:
    return f"{key.id}  {key.key_type}  {key.fingerprint}  {key.name}"


@app.command()
def add(
    source: Annotated[str, typer.Argument(help="A public key file (~/.ssh/id_ed25519.pub), "
                                               "or - for stdin")],
    name: Annotated[str | None, typer.Option(help="A name (default: the key's comment)")] = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Add an OpenSSH public key (ed25519, ecdsa, rsa >= 2048 bits) to the project."""
    resources.say(lambda api: api.add_ssh_key(_read(source), name), output,
                  lambda key: f"added {_summary(key)}")


@app.command("list")
def list_(output: OutputOption = OutputFormat.TABLE) -> None:
    """The project's SSH keys."""
    resources.list_rows(lambda api: api.list_ssh_keys(), output,
                        ["ID", "NAME", "TYPE", "FINGERPRINT", "ADDED"],
                        lambda k: [k.id, k.name, k.key_type, k.fingerprint,
                                   k.created_at.isoformat(timespec="seconds")])


@app.command()
def remove(key: Annotated[str, typer.Argument(help="Key id, name or fingerprint")],
           output: OutputOption = OutputFormat.TABLE) -> None:
    """Remove a key; it no longer gets into the project's pods."""
    resources.say(lambda api: api.remove_ssh_key(key), output,
                  lambda removed: f"removed {_summary(removed)}")
