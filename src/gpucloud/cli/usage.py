"""`gpucloud usage` and `gpucloud invoice`: what a project used and what it costs."""

from __future__ import annotations

import csv
import io
import json
import re
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated

import typer

from gpucloud.cli.common import CliError, OutputFormat, OutputOption, cli_errors, client, emit
from gpucloud.cli.common import table as print_table
from gpucloud.core.billing import (
    ALLOCATED_FIELDS,
    MEASURED_FIELDS,
    InvoiceOut,
    UsageBy,
    UsageOut,
)

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
CSV_COLUMNS = ("key", "pod", "job_id", "gpu_type", "day", "runs", "seconds", "gpu_seconds",
               "cpu_core_seconds", "gpu_util_avg", "cpu_seconds", "cost", "credited")


class UsageFormat(StrEnum):
    TABLE = "table"
    JSON = "json"
    CSV = "csv"


def parse_time(option: str, value: str | None, now: datetime) -> str | None:
    """``7d``/``12h``/``30m``/``90s`` ago, or an ISO 8601 date or time (UTC if no zone)."""
    if value is None:
        return None
    match = _RELATIVE.match(value.strip())
    if match:
        ago = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        return (now - timedelta(seconds=ago)).isoformat()
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        raise CliError(f"{option}: {value!r} is neither a time (2026-12-01T00:00) nor an age "
                       "(7d, 12h, 30m)") from None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).isoformat()


def usage(
    project: Annotated[str | None, typer.Option(help="A project (admin); default yours")]
    = None,
    since: Annotated[str | None, typer.Option(help="From (ISO time or age: 7d); default 30d")]
    = None,
    until: Annotated[str | None, typer.Option(help="Until (ISO time or age); default now")]
    = None,
    by: Annotated[UsageBy, typer.Option(help="pod, job, gpu-type or day",
                                        case_sensitive=False)] = UsageBy.POD,
    output: Annotated[UsageFormat, typer.Option("--output", "-o", help="table, json or csv",
                                                case_sensitive=False)] = UsageFormat.TABLE,
) -> None:
    """Usage and cost per pod, job, GPU type or day. gpu_seconds and cost are billed by
    allocation (start/stop times × GPUs); gpu_util_avg and cpu_seconds are measured."""
    with cli_errors():
        now = datetime.now(UTC)
        out = client().usage(project, parse_time("--since", since, now),
                             parse_time("--until", until, now), by.value)
        if output is UsageFormat.JSON:
            typer.echo(json.dumps([row.model_dump(mode="json") for row in out.rows], indent=2))
        elif output is UsageFormat.CSV:
            typer.echo(_csv(out), nl=False)
        else:
            _table(out)


def _csv(out: UsageOut) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in out.rows:
        data = row.model_dump(mode="json")
        writer.writerow(["" if data[c] is None else data[c] for c in CSV_COLUMNS])
    return buffer.getvalue()


def _table(out: UsageOut) -> None:
    print_table(
        [out.by.value.upper(), "RUNS", "SECONDS", "GPU-SECONDS", "GPU UTIL %", "CPU-SECONDS",
         "COST", "CREDITED"],
        [[row.pod or row.key, row.runs, f"{row.seconds:.0f}", f"{row.gpu_seconds:.0f}",
          "" if row.gpu_util_avg is None else f"{row.gpu_util_avg:.1f}",
          "" if row.cpu_seconds is None else f"{row.cpu_seconds:.1f}", f"${row.cost}",
          f"${row.credited}" if row.credited else ""] for row in out.rows])
    typer.echo(f"project {out.project}, {out.since.isoformat(timespec='seconds')} to "
               f"{out.until.isoformat(timespec='seconds')}: ${out.total_cost}")
    typer.echo(f"allocated (billed): {', '.join(ALLOCATED_FIELDS)}; "
               f"measured: {', '.join(MEASURED_FIELDS)}")


def invoice(
    project: str,
    month: Annotated[str, typer.Option(help="The month, YYYY-MM")],
    output: OutputOption = OutputFormat.TABLE,
) -> None:
    """A project's invoice for a month: totals per resource, exact to the micro-dollar."""
    with cli_errors():
        out = client().invoice(project, month)
        emit(out, output, lambda: _invoice_table(out))


def _invoice_table(out: InvoiceOut) -> None:
    print_table(
        ["DESCRIPTION", "QUANTITY", "UNIT", "UNIT PRICE", "AMOUNT"],
        [[line.description, line.quantity, line.unit, f"${line.unit_price}",
          f"${line.amount}"] for line in out.lines])
    typer.echo(f"invoice {out.project} {out.month}: charges ${out.charges}, credits "
               f"${out.credits}, total ${out.total} {out.currency}")
