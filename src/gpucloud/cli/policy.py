"""`gpucloud priority-class …` and `gpucloud quota …`: scheduling policy."""

from __future__ import annotations

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
    table,
)
from gpucloud.cli.spec import build_request
from gpucloud.core.policy import PriorityClassCreateRequest, QuotaOut, QuotaSetRequest

priority_app = typer.Typer(help="Priority classes: who may preempt whom.",
                           no_args_is_help=True)
quota_app = typer.Typer(help="Project quotas: guaranteed GPUs and borrowing.",
                        no_args_is_help=True)


@priority_app.command("list")
def list_classes(output: OutputOption = OutputFormat.TABLE) -> None:
    """List priority classes, lowest first."""
    resources.list_rows(lambda api: api.list_priority_classes(), output,
                        ["NAME", "VALUE", "DESCRIPTION"],
                        lambda c: [c.name, c.value, c.description or ""])


@priority_app.command("create")
def create_class(
    name: str,
    value: Annotated[int, typer.Option(help="Priority: higher preempts lower")],
    description: Annotated[str | None, typer.Option(help="What the class is for")] = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Create a priority class (admin only)."""
    with cli_errors():
        request = build_request(PriorityClassCreateRequest, {
            "name": name, "value": value, "description": description})
        created = client().create_priority_class(request)
        emit(created, output, lambda: typer.echo(
            f"priority class {created.name} created ({created.value})"))


def _gpus(specs: list[str]) -> dict[str, int]:
    gpus: dict[str, int] = {}
    for spec in specs:
        model, sep, count = spec.partition("=")
        if not sep or not count.strip().isdigit():
            raise CliError(f"--gpus {spec!r}: expected MODEL=COUNT, e.g. H100-80GB=8")
        gpus[model.strip()] = int(count)
    return gpus


QUOTA_COLUMNS = ["PROJECT", "GPUS (USED/QUOTA)", "BORROW LIMIT"]


def _quota_row(quota: QuotaOut) -> list[object]:
    models = sorted(set(quota.gpus) | set(quota.used))
    return [quota.project,
            ", ".join(f"{m}={quota.used.get(m, 0):g}/{quota.gpus.get(m, 0)}" for m in models),
            "unlimited" if quota.borrow_limit is None else quota.borrow_limit]


@quota_app.command("set")
def set_quota(
    project: str,
    gpus: Annotated[list[str] | None, typer.Option(
        help="MODEL=COUNT guaranteed GPUs, repeatable")] = None,
    borrow_limit: Annotated[int, typer.Option(
        help="GPUs the project may use beyond its quota, in all")] = 0,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Set a project's quota (admin only): gpucloud quota set team-a --gpus H100-80GB=8"""
    with cli_errors():
        request = build_request(QuotaSetRequest, {"gpus": _gpus(gpus or []),
                                                  "borrow_limit": borrow_limit})
        quota = client().set_quota(project, request)
        emit(quota, output, lambda: table(QUOTA_COLUMNS, [_quota_row(quota)]))


@quota_app.command("list")
def list_quotas(output: OutputOption = OutputFormat.TABLE) -> None:
    """List quotas and what each project uses (admin: all; others: their own)."""
    resources.list_rows(lambda api: api.list_quotas(), output, QUOTA_COLUMNS, _quota_row)
