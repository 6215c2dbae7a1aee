"""`gpucloud project limit …`: a project's spend limit per hour and prepaid credit."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from gpucloud.cli import resources
from gpucloud.cli.common import OutputFormat, OutputOption, cli_errors, client, emit, fields
from gpucloud.core.billing import SpendLimitOut

app = typer.Typer(help="Spend limits and prepaid credit of a project.", no_args_is_help=True)
_NONE = "none"


def _amount(value: str) -> str | None:
    """An amount as typed; ``none`` clears it."""
    return None if value.strip().lower() == _NONE else value


@app.command("set")
def set_limit(
    project: str,
    per_hour: Annotated[str | None, typer.Option(
        help="Most USD per hour its admitted pods may cost (none: no limit)")] = None,
    credit: Annotated[str | None, typer.Option(
        help="A prepaid balance in USD from now on (none: postpaid)")] = None,
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """Set a project's spend limit and/or prepaid credit (admin)."""
    with cli_errors():
        body: dict[str, Any] = {}
        if per_hour is not None:
            body["per_hour"] = _amount(per_hour)
        if credit is not None:
            body["credit"] = _amount(credit)
        out = client().set_spend_limit(project, body)
        emit(out, output, lambda: _show(out))


@app.command("get")
def get_limit(project: str, output: OutputOption = OutputFormat.TABLE) -> None:
    """A project's limit, what its admitted pods reserve, and its balance."""
    resources.show(lambda api: api.get_spend_limit(project), output, _show)


def _money(value: object) -> str | None:
    return None if value is None else f"${value}"


def _show(out: SpendLimitOut) -> None:
    fields([
        ("project", out.project),
        ("limit per hour", _money(out.per_hour) or "none"),
        ("reserved per hour", _money(out.reserved_per_hour)),
        ("credit", _money(out.credit) or "none (postpaid)"),
        ("credit since", out.credit_since.isoformat(timespec="seconds")
         if out.credit_since else None),
        ("spent since", _money(out.spent_since_credit)),
        ("balance", _money(out.balance)),
    ])
