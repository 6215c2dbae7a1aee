"""The body that resource commands (pod, job, template, endpoint, volume, node …) share:
ask the API once, print the answer as JSON (``--output json``) or in its human form, and
turn an expected error into one line on stderr and exit status 1.

Each helper takes ``call``, what to ask of the API client, so a command keeps its own
name, arguments and help and only says what differs: which call, and how to show it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import typer

from gpucloud.cli.common import (
    Item,
    OutputFormat,
    cli_errors,
    client,
    emit,
    emit_deleted,
    emit_table,
)
from gpucloud.client import GpucloudClient


def show(call: Callable[[GpucloudClient], Item], output: OutputFormat,
         render: Callable[[Item], None]) -> None:
    """A get command: the answer of ``call`` as JSON, or ``render(answer)``."""
    with cli_errors():
        found = call(client())
        emit(found, output, lambda: render(found))


def say(call: Callable[[GpucloudClient], Item], output: OutputFormat,
        line: Callable[[Item], str]) -> None:
    """A create or action command: the answer as JSON, or one line about it
    (``node n1 cordoned``)."""
    show(call, output, lambda found: typer.echo(line(found)))


def list_rows(call: Callable[[GpucloudClient], Sequence[Item]], output: OutputFormat,
              columns: Sequence[str], row: Callable[[Item], Sequence[Any]]) -> None:
    """A list command: the items as JSON, or a table of one ``row(item)`` each."""
    with cli_errors():
        emit_table(call(client()), output, columns, row)


def delete(call: Callable[[GpucloudClient], object], noun: str, ref: str,
           output: OutputFormat, verb: str = "deleted") -> None:
    """A delete command: ``{"deleted": ref}`` as JSON, or ``<noun> <ref> deleted``."""
    with cli_errors():
        call(client())
        emit_deleted(noun, ref, output, verb)
